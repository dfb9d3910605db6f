/* generate: complete a prompt with the kvd daemon, streaming the text to stdout. Ctrl-C stops the generation.
 *
 *   build/generate [-e ENDPOINT] [-n MAX_TOKENS] [-t TEMPERATURE] [-T TIMEOUT_S] PROMPT...
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvd.h"

static kvd_client *client;

static void on_sigint(int sig) {
    (void)sig;
    kvd_abort(client, KVD_ABORT_CURRENT); /* async-signal-safe */
}

static int print_chunk(const kvd_chunk *chunk, void *user_data) {
    (void)user_data;
    fwrite(chunk->text, 1, chunk->text_len, stdout);
    fflush(stdout);
    return 0;
}

static int usage(void) {
    fprintf(stderr, "usage: generate [-e ENDPOINT] [-n MAX_TOKENS] [-t TEMPERATURE] [-T TIMEOUT_S] PROMPT...\n");
    return 2;
}

/* The whole of `text` as a number (an integer where `whole`): 0 and *out set, or -1 for anything else. */
static int parse_number(const char *text, int whole, double *out) {
    char *end;
    *out = whole ? (double)strtoll(text, &end, 10) : strtod(text, &end);
    return end != text && *end == '\0' ? 0 : -1;
}

/* The words of argv joined by spaces. */
static char *join(int argc, char **argv) {
    size_t len = 1;
    for (int i = 0; i < argc; i++) len += strlen(argv[i]) + 1;
    char *text = calloc(len, 1);
    for (int i = 0; text != NULL && i < argc; i++) {
        if (i > 0) strcat(text, " ");
        strcat(text, argv[i]);
    }
    return text;
}

int main(int argc, char **argv) {
    const char *endpoint = NULL;
    kvd_request request;
    kvd_request_init(&request);
    request.max_tokens = 256;
    double timeout_s = KVD_DEFAULT_TIMEOUT_MS / 1000.0;
    int opt;
    double value;
    while ((opt = getopt(argc, argv, "e:n:t:T:")) != -1) {
        if (opt != 'e' && opt != '?' && parse_number(optarg, opt == 'n', &value) != 0) {
            fprintf(stderr, "generate: -%c takes a %snumber, got '%s'\n", opt, opt == 'n' ? "whole " : "", optarg);
            return usage();
        }
        switch (opt) {
        case 'e': endpoint = optarg; break;
        case 'n': request.max_tokens = (int64_t)value; break;
        case 't': request.temperature = value; break;
        case 'T': timeout_s = value; break;
        default: return usage();
        }
    }
    if (optind >= argc || timeout_s <= 0) return usage();
    char *prompt = join(argc - optind, argv + optind);
    if (prompt == NULL) return 1;
    request.prompt = prompt;

    kvd_error error;
    if (kvd_connect(endpoint, &client, &error) != KVD_OK) {
        fprintf(stderr, "generate: %s\n", error.message);
        free(prompt);
        return 1;
    }
    kvd_set_timeout(client, (int)(timeout_s * 1000));
    struct sigaction action = {.sa_handler = on_sigint};
    sigaction(SIGINT, &action, NULL);

    kvd_result result;
    kvd_status status = kvd_generate(client, &request, print_chunk, NULL, &result);
    if (status == KVD_OK || result.text_len > 0) putchar('\n');
    if (status != KVD_OK)
        fprintf(stderr, "generate: %s: %s\n", result.error.code, result.error.message);
    else if (strcmp(result.finish_reason, "abort") == 0)
        fprintf(stderr, "generate: aborted after %lld tokens\n", (long long)result.usage.completion_tokens);
    kvd_result_free(&result);
    kvd_close(client);
    free(prompt);
    return status == KVD_OK ? 0 : 1;
}
