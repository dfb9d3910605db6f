/* test_client: runs one call of the library and prints what happened as one JSON object, for
 * tests/test_c_client.py to compare with the Python client.
 *
 *   test_client generate [-e ENDPOINT] [-T TIMEOUT_MS] (-p PROMPT | -i ID,ID,... | -m ROLE[=CONTENT]...)
 *                        [-n MAX_TOKENS] [-t TEMPERATURE] [-k TOP_K] [-X SEED] [-x STOP] [-E] [-s] [-a CHUNKS]
 *                        [-J SCHEMA | -O | -r REGEX | -g GRAMMAR] [-b ID=BIAS]... [-L N] [-P N]
 *                        [-o TOOLS_JSON] [-c TOOL_CHOICE | -f FUNCTION] [-Q 0|1]
 *                        [-C TOOL_CALL_ID] [-N NAME] [-K ID=NAME=ARGUMENTS]...
 *   test_client embed [-e ENDPOINT] [-T TIMEOUT_MS] (-w TEXT... | -I ID,ID,...) [-d DIMENSIONS]
 *   test_client health [-e ENDPOINT] [-T TIMEOUT_MS]
 *   test_client resolve [-e ENDPOINT]
 *   test_client private-dir DIR   (the library's internal check of the default endpoint's /tmp folder)
 *
 * -E: ignore_eos; -s: stream (print every chunk); -a N: kvd_abort from the callback after N chunks.
 * -J json_schema (JSON text), -O json_object, -r regex, -g grammar; -b: a logit_bias entry; -L logprobs,
 * -P prompt_logprobs; -o tools, -c tool_choice, -f a tool_choice naming that function, -Q parallel_tool_calls.
 * -m without '=' is a message whose content is nil; -C, -N and -K (a tool call) apply to the last -m.
 * The exit status is 0 when the call returned KVD_OK, 1 when it failed, 2 on a usage error.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h" /* kvd_check_private_dir; links against the static library, where it is visible */
#include "kvd.h"

#define MAX_MESSAGES 16
#define MAX_ITEMS 16 /* logit_bias entries, tool calls, embed inputs */

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

static void json_double(FILE *out, double x) {
    if (isnan(x)) fprintf(out, "NaN");
    else if (isinf(x)) fprintf(out, x < 0 ? "-Infinity" : "Infinity");
    else fprintf(out, "%.17g", x);
}

static void json_logprobs(FILE *out, const kvd_logprob *logprobs, size_t n) {
    if (logprobs == NULL) {
        fprintf(out, "null");
        return;
    }
    fputc('[', out);
    for (size_t i = 0; i < n; i++) {
        const kvd_logprob *lp = &logprobs[i];
        if (i) fprintf(out, ", ");
        if (lp->token_id < 0) {
            fprintf(out, "null");
            continue;
        }
        fprintf(out, "{\"token_id\": %d, \"logprob\": ", lp->token_id);
        json_double(out, lp->logprob);
        fprintf(out, ", \"top_logprobs\": [");
        for (size_t j = 0; j < lp->num_top_logprobs; j++) {
            fprintf(out, "%s[%d, ", j ? ", " : "", lp->top_logprobs[j].token_id);
            json_double(out, lp->top_logprobs[j].logprob);
            fputc(']', out);
        }
        fprintf(out, "]}");
    }
    fputc(']', out);
}

static void json_cstr(FILE *out, const char *s) { json_str(out, s, strlen(s)); }

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
    fprintf(s->chunks, ", \"logprobs\": ");
    json_logprobs(s->chunks, chunk->logprobs, chunk->num_token_ids);
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

/* Split "A=B" (or "A=B=C" with three parts) at its first '='s, in place. */
static int split(char *text, char **parts, int n) {
    parts[0] = text;
    for (int i = 1; i < n; i++) {
        char *eq = strchr(parts[i - 1], '=');
        if (eq == NULL) return -1;
        *eq = '\0';
        parts[i] = eq + 1;
    }
    return 0;
}

static double elapsed_ms(const struct timespec *start) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - start->tv_sec) * 1e3 + (now.tv_nsec - start->tv_nsec) / 1e6;
}

static int usage(void) {
    fprintf(stderr, "usage: test_client generate|health|resolve|private-dir [options]; see tests/test_client.c\n");
    return 2;
}

static int check_private_dir(const char *dir) {
    kvd_error error;
    memset(&error, 0, sizeof error);
    kvd_status status = kvd_check_private_dir(dir, &error);
    printf("{");
    json_error(stdout, status, &error);
    printf("}\n");
    return status == KVD_OK ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    if (strcmp(argv[1], "private-dir") == 0) return argc == 3 ? check_private_dir(argv[2]) : usage();
    static kvd_tool_call tool_calls[MAX_MESSAGES][MAX_ITEMS];
    kvd_logit_bias bias[MAX_ITEMS];
    const char *texts[MAX_ITEMS];
    int32_t *token_inputs[MAX_ITEMS];
    size_t token_counts[MAX_ITEMS];
    size_t num_texts = 0, num_token_inputs = 0;
    kvd_embed_request embed_request;
    kvd_embed_request_init(&embed_request);
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
    kvd_message *last = NULL;
    char *parts[3];
    while ((opt = getopt(argc, argv, "e:T:p:i:m:n:t:k:X:x:Esa:J:Or:g:b:L:P:o:c:f:Q:C:N:K:w:I:d:")) != -1) {
        switch (opt) {
        case 'e': endpoint = optarg; break;
        case 'T': timeout_ms = atoi(optarg); break;
        case 'p': request.prompt = optarg; break;
        case 'i':
            if (parse_ids(optarg, &ids, &request.num_prompt_token_ids) != 0) return usage();
            request.prompt_token_ids = ids;
            break;
        case 'm': {
            if (num_messages == MAX_MESSAGES) return usage();
            char *eq = strchr(optarg, '=');
            if (eq != NULL) *eq = '\0';
            last = &messages[num_messages++];
            memset(last, 0, sizeof *last);
            last->role = optarg;
            last->content = eq != NULL ? eq + 1 : NULL;
            request.messages = messages;
            request.num_messages = num_messages;
            break;
        }
        case 'C':
            if (last == NULL) return usage();
            last->tool_call_id = optarg;
            break;
        case 'N':
            if (last == NULL) return usage();
            last->name = optarg;
            break;
        case 'K': {
            if (last == NULL || last->num_tool_calls == MAX_ITEMS || split(optarg, parts, 3) != 0) return usage();
            kvd_tool_call *calls = tool_calls[last - messages];
            calls[last->num_tool_calls++] = (kvd_tool_call){parts[0], parts[1], parts[2]};
            last->tool_calls = calls;
            break;
        }
        case 'J': request.json_schema = optarg; break;
        case 'O': request.json_object = 1; break;
        case 'r': request.regex = optarg; break;
        case 'g': request.grammar = optarg; break;
        case 'b':
            if (request.num_logit_bias == MAX_ITEMS || split(optarg, parts, 2) != 0) return usage();
            bias[request.num_logit_bias++] = (kvd_logit_bias){(int32_t)atoi(parts[0]), strtod(parts[1], NULL)};
            request.logit_bias = bias;
            break;
        case 'L': request.logprobs = strtoll(optarg, NULL, 10); break;
        case 'P': request.prompt_logprobs = strtoll(optarg, NULL, 10); break;
        case 'o': request.tools_json = optarg; break;
        case 'c': request.tool_choice = optarg; break;
        case 'f': request.tool_choice_function = optarg; break;
        case 'Q': request.parallel_tool_calls = atoi(optarg); break;
        case 'w':
            if (num_texts == MAX_ITEMS) return usage();
            texts[num_texts++] = optarg;
            embed_request.texts = texts;
            embed_request.num_inputs = num_texts;
            break;
        case 'I':
            if (num_token_inputs == MAX_ITEMS ||
                parse_ids(optarg, &token_inputs[num_token_inputs], &token_counts[num_token_inputs]) != 0)
                return usage();
            num_token_inputs++;
            embed_request.token_ids = (const int32_t *const *)token_inputs;
            embed_request.num_token_ids = token_counts;
            embed_request.num_inputs = num_token_inputs;
            break;
        case 'd': embed_request.dimensions = strtoll(optarg, NULL, 10); break;
        case 'n': request.max_tokens = strtoll(optarg, NULL, 10); break;
        case 't': request.temperature = strtod(optarg, NULL); break;
        case 'k': request.top_k = strtoll(optarg, NULL, 10); break;
        case 'X': request.seed = strtoll(optarg, NULL, 10); break;
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
    if (strcmp(mode, "generate") != 0 && strcmp(mode, "health") != 0 && strcmp(mode, "embed") != 0)
        return usage();

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
    } else if (strcmp(mode, "embed") == 0) {
        kvd_embeddings embeddings;
        status = kvd_embed(client, &embed_request, &embeddings);
        printf(", ");
        json_error(stdout, status, &embeddings.error);
        printf(", \"dimensions\": %zu, \"pooling\": ", embeddings.dimensions);
        json_cstr(stdout, embeddings.pooling);
        printf(", \"prompt_tokens\": %lld, \"embeddings\": [", (long long)embeddings.prompt_tokens);
        for (size_t i = 0; i < embeddings.num_vectors; i++) {
            printf("%s[", i ? ", " : "");
            for (size_t j = 0; j < embeddings.dimensions; j++) {
                if (j) printf(", ");
                json_double(stdout, embeddings.data[i * embeddings.dimensions + j]);
            }
            printf("]");
        }
        printf("]");
        kvd_embeddings_free(&embeddings);
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
        printf(", \"logprobs\": ");
        json_logprobs(stdout, result.logprobs, result.num_logprobs);
        printf(", \"prompt_logprobs\": ");
        json_logprobs(stdout, result.prompt_logprobs, result.num_prompt_logprobs);
        printf(", \"tool_calls\": [");
        for (size_t i = 0; i < result.num_tool_calls; i++) {
            printf("%s{\"id\": ", i ? ", " : "");
            json_cstr(stdout, result.tool_calls[i].id);
            printf(", \"name\": ");
            json_cstr(stdout, result.tool_calls[i].name);
            printf(", \"arguments\": ");
            json_cstr(stdout, result.tool_calls[i].arguments);
            printf("}");
        }
        printf("]");
        printf(", \"chunks\": [%s]", chunks_text);
        free(chunks_text);
        kvd_result_free(&result);
    }
    printf(", \"elapsed_ms\": %.1f}\n", elapsed_ms(&start));
    kvd_close(client);
    free(ids);
    for (size_t i = 0; i < num_token_inputs; i++) free(token_inputs[i]);
    return status == KVD_OK ? 0 : 1;
}
