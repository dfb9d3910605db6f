/* test_client: runs one call of the library and prints what happened as one JSON object, for
 * tests/test_c_client.py to compare with the Python client.
 *
 *   test_client generate [-e ENDPOINT] [-T TIMEOUT_MS] (-p PROMPT | -i ID,ID,... | -m ROLE=CONTENT...)
 *                        [-n MAX_TOKENS] [-t TEMPERATURE] [-k TOP_K] [-x STOP] [-E] [-s] [-a CHUNKS]
 *   test_client health [-e ENDPOINT] [-T TIMEOUT_MS]
 *   test_client resolve [-e ENDPOINT]
 *
 * -E: ignore_eos; -s: stream (print every chunk); -a N: kvd_abort from the callback after N chunks.
 * The exit status is 0 when the call returned KVD_OK, 1 when it failed, 2 on a usage error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvd.h"

#define MAX_MESSAGES 16

static void json_str(FILE *out, const char *s, size_t len) {
    fputc('"', out);
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            fprintf(out, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(out, "\\u%04x", ch);
        else
            fputc(ch, out); /* UTF-8 passes through: JSON text is UTF-8 */
    }
    fputc('"', out);
}

static void json_ids(FILE *out, const int32_t *ids, size_t n) {
    fputc('[', out);
    for (size_t i = 0; i < n; i++) fprintf(out, "%s%d", i ? ", " : "", ids[i]);
    fputc(']', out);
}

static void json_error(FILE *out, kvd_status status, const kvd_error *error) {
    fprintf(out, "\"status\": \"%s\"", kvd_status_name(status));
    if (status == KVD_OK) return;
    fprintf(out, ", \"code\": ");
    json_str(out, error->code, strlen(error->code));
    fprintf(out, ", \"field\": ");
    json_str(out, error->field, strlen(error->field));
    fprintf(out, ", \"message\": ");
    json_str(out, error->message, strlen(error->message));
}

typedef struct streaming {
    kvd_client *client;
    FILE *chunks; /* the JSON array of chunks, without brackets */
    int count;
    int abort_after; /* 0: never */
} streaming;

static int on_chunk(const kvd_chunk *chunk, void *user_data) {
    streaming *s = user_data;
    fprintf(s->chunks, "%s{\"request_id\": %llu, \"text\": ", s->count ? ", " : "",
            (unsigned long long)chunk->request_id);
    json_str(s->chunks, chunk->text, chunk->text_len);
    fprintf(s->chunks, ", \"token_ids\": ");
    json_ids(s->chunks, chunk->token_ids, chunk->num_token_ids);
    fprintf(s->chunks, ", \"is_final\": %s}", chunk->is_final ? "true" : "false");
    if (++s->count == s->abort_after) kvd_abort(s->client, chunk->request_id);
    return 0;
}

static int parse_ids(const char *text, int32_t **ids, size_t *n) {
    size_t cap = 1;
    for (const char *p = text; *p; p++) cap += *p == ',';
    *ids = malloc(cap * sizeof **ids);
    *n = 0;
    for (const char *p = text; *ids != NULL && *p;) {
        char *end;
        (*ids)[(*n)++] = (int32_t)strtol(p, &end, 10);
        if (end == p) return -1;
        p = *end == ',' ? end + 1 : end;
    }
    return *ids == NULL ? -1 : 0;
}

static double elapsed_ms(const struct timespec *start) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - start->tv_sec) * 1e3 + (now.tv_nsec - start->tv_nsec) / 1e6;
}

static int usage(void) {
    fprintf(stderr, "usage: test_client generate|health|resolve [options]; see tests/test_client.c\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    const char *mode = argv[1];
    const char *endpoint = NULL;
    int timeout_ms = KVD_DEFAULT_TIMEOUT_MS, stream = 0, abort_after = 0;
    kvd_request request;
    kvd_request_init(&request);
    kvd_message messages[MAX_MESSAGES];
    size_t num_messages = 0;
    int32_t *ids = NULL;
    const char *stop[1];
    int opt;
    optind = 2;
    while ((opt = getopt(argc, argv, "e:T:p:i:m:n:t:k:x:Esa:")) != -1) {
        switch (opt) {
        case 'e': endpoint = optarg; break;
        case 'T': timeout_ms = atoi(optarg); break;
        case 'p': request.prompt = optarg; break;
        case 'i':
            if (parse_ids(optarg, &ids, &request.num_prompt_token_ids) != 0) return usage();
            request.prompt_token_ids = ids;
            break;
        case 'm': {
            char *eq = strchr(optarg, '=');
            if (eq == NULL || num_messages == MAX_MESSAGES) return usage();
            *eq = '\0';
            messages[num_messages++] = (kvd_message){optarg, eq + 1};
            request.messages = messages;
            request.num_messages = num_messages;
            break;
        }
        case 'n': request.max_tokens = strtoll(optarg, NULL, 10); break;
        case 't': request.temperature = strtod(optarg, NULL); break;
        case 'k': request.top_k = strtoll(optarg, NULL, 10); break;
        case 'x':
            stop[0] = optarg;
            request.stop = stop;
            request.num_stop = 1;
            break;
        case 'E': request.ignore_eos = 1; break;
        case 's': stream = 1; break;
        case 'a': abort_after = atoi(optarg); break;
        default: return usage();
        }
    }

    kvd_error error;
    memset(&error, 0, sizeof error);
    kvd_status status;
    if (strcmp(mode, "resolve") == 0) {
        char url[4096];
        status = kvd_resolve_endpoint(endpoint, url, sizeof url, &error);
        printf("{");
        json_error(stdout, status, &error);
        printf(", \"url\": ");
        json_str(stdout, status == KVD_OK ? url : "", status == KVD_OK ? strlen(url) : 0);
        printf("}\n");
        return status == KVD_OK ? 0 : 1;
    }
    if (strcmp(mode, "generate") != 0 && strcmp(mode, "health") != 0) return usage();

    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    kvd_client *client;
    status = kvd_connect(endpoint, &client, &error);
    if (status == KVD_OK) status = kvd_set_timeout(client, timeout_ms);
    if (status != KVD_OK) {
        printf("{");
        json_error(stdout, status, &error);
        printf("}\n");
        return 1;
    }
    printf("{\"endpoint\": ");
    json_str(stdout, kvd_endpoint(client), strlen(kvd_endpoint(client)));
    if (strcmp(mode, "health") == 0) {
        char health[32] = "";
        status = kvd_health(client, health, sizeof health, &error);
        printf(", ");
        json_error(stdout, status, &error);
        printf(", \"health\": ");
        json_str(stdout, health, strlen(health));
    } else {
        char *chunks_text = NULL;
        size_t chunks_len = 0;
        streaming s = {client, open_memstream(&chunks_text, &chunks_len), 0, abort_after};
        if (s.chunks == NULL) return 1;
        kvd_result result;
        status = kvd_generate(client, &request, stream ? on_chunk : NULL, &s, &result);
        fclose(s.chunks);
        printf(", ");
        json_error(stdout, status, &result.error);
        printf(", \"request_id\": %llu, \"text\": ", (unsigned long long)result.request_id);
        json_str(stdout, result.text ? result.text : "", result.text_len);
        printf(", \"token_ids\": ");
        json_ids(stdout, result.token_ids, result.num_token_ids);
        printf(", \"finish_reason\": ");
        json_str(stdout, result.finish_reason, strlen(result.finish_reason));
        printf(", \"usage\": {\"prompt_tokens\": %lld, \"completion_tokens\": %lld, \"cached_tokens\": %lld}",
               (long long)result.usage.prompt_tokens, (long long)result.usage.completion_tokens,
               (long long)result.usage.cached_tokens);
        printf(", \"chunks\": [%s]", chunks_text);
        free(chunks_text);
        kvd_result_free(&result);
    }
    printf(", \"elapsed_ms\": %.1f}\n", elapsed_ms(&start));
    kvd_close(client);
    free(ids);
    return status == KVD_OK ? 0 : 1;
}
