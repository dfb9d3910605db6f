/* kvd.h: a C client for the kvd inference daemon (msgpack over ZeroMQ, docs/protocol.md).
 *
 * One kvd_client is one DEALER connection. Calls block until their request ends; kvd_generate streams the
 * completion through a callback as the daemon produces it. A client is not thread-safe (ZeroMQ sockets are
 * not), except kvd_abort, which any thread or a signal handler may call.
 */
#ifndef KVD_H
#define KVD_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's interface; everything else in libkvd.so is hidden (-fvisibility=hidden). */
#define KVD_API __attribute__((visibility("default")))

#define KVD_PROTOCOL_VERSION 1
#define KVD_DEFAULT_TIMEOUT_MS 30000
/* Integer request fields left at this value (and double fields left NAN) take the daemon's default. */
#define KVD_UNSET INT64_MIN
/* kvd_abort target meaning "the generation in flight on this client". Request ids start at 1. */
#define KVD_ABORT_CURRENT 0

typedef enum kvd_status {
    KVD_OK = 0,
    /* The daemon's error replies (docs/protocol.md, "Errors"). */
    KVD_ERR_BAD_REQUEST = 1,
    KVD_ERR_UNSUPPORTED_VERSION = 2,
    KVD_ERR_TOO_LARGE = 3,
    KVD_ERR_OVERLOADED = 4,
    KVD_ERR_NOT_FOUND = 5,
    KVD_ERR_SHUTTING_DOWN = 6,
    KVD_ERR_INTERNAL = 7,
    KVD_ERR_DAEMON_OTHER = 8, /* an error code this library does not know (a newer daemon): see error.code */
    KVD_ERR_CLIENT_TIMEOUT = 9, /* this client read nothing for the daemon's client timeout: request aborted */
    /* Local failures. */
    KVD_ERR_NO_DAEMON = 100, /* silence for the whole timeout, and the ipc socket file does not exist */
    KVD_ERR_TIMEOUT = 101,   /* the daemon said nothing for the whole timeout */
    KVD_ERR_PROTOCOL = 102,  /* the daemon sent a reply this library cannot decode */
    KVD_ERR_ENDPOINT = 103,  /* a malformed endpoint, or an unsafe /tmp folder for the default one */
    KVD_ERR_INVALID_ARGUMENT = 104,
    KVD_ERR_NO_MEMORY = 105,
    KVD_ERR_ZMQ = 106, /* a ZeroMQ call failed; the message says which */
} kvd_status;

/* The snake_case name of a status: the protocol's code ("bad_request") or a local one ("no_daemon"). */
KVD_API const char *kvd_status_name(kvd_status status);

/* What went wrong, filled by every call that fails. */
typedef struct kvd_error {
    kvd_status status;
    char code[32];     /* the daemon's error code as sent, or kvd_status_name(status) for local failures */
    char field[64];    /* the request field at fault, or "" */
    char message[512]; /* one line that says what to do */
} kvd_error;

/* A tool call: one of an assistant message's earlier calls in a request, or one the model made in a result. */
typedef struct kvd_tool_call {
    const char *id;        /* "call_..." */
    const char *name;      /* the function's name */
    const char *arguments; /* the arguments as JSON text of an object */
} kvd_tool_call;

/* A chat message. Only role is required: content NULL is sent as nil (an assistant turn that only calls
 * tools); tool_calls are an assistant's earlier calls, tool_call_id the call a "tool" message answers. */
typedef struct kvd_message {
    const char *role;
    const char *content;
    const kvd_tool_call *tool_calls;
    size_t num_tool_calls;
    const char *tool_call_id;
    const char *name;
} kvd_message;

/* One logit_bias entry: `bias` in [-100, 100] is added to token_id's logit before sampling (-100 bans it). */
typedef struct kvd_logit_bias {
    int32_t token_id;
    double bias;
} kvd_logit_bias;

/* A generation request. Set exactly one of prompt, prompt_token_ids and messages (messages makes it a chat
 * request: the daemon applies the model's chat template). Call kvd_request_init first: it leaves every
 * sampling field unset, so that the daemon's defaults apply. The names are the protocol's fields. */
typedef struct kvd_request {
    const char *prompt;
    const int32_t *prompt_token_ids;
    size_t num_prompt_token_ids;
    const kvd_message *messages;
    size_t num_messages;

    int64_t max_tokens; /* daemon default 16 */
    double temperature; /* 0 = greedy; daemon default 1.0 */
    double top_p;
    int64_t top_k;
    double min_p;
    int64_t seed;
    const char *const *stop; /* stop strings (not included in the text) */
    size_t num_stop;
    const int32_t *stop_token_ids;
    size_t num_stop_token_ids;
    int ignore_eos; /* nonzero: keep generating past the end-of-sequence token */
    double presence_penalty;
    double frequency_penalty;
    double repetition_penalty;
    const char *cache_salt; /* requests share prefix-cache blocks only with the same salt */

    const kvd_logit_bias *logit_bias; /* at most 512 entries */
    size_t num_logit_bias;
    int64_t logprobs;        /* [0, 20]: result->logprobs, with this many alternatives per token */
    int64_t prompt_logprobs; /* [0, 20]: result->prompt_logprobs (such a request skips the prefix cache) */

    /* Structured output: set at most one; the output is then constrained to the language it describes. */
    const char *json_schema; /* a JSON Schema as JSON text */
    int json_object;         /* nonzero: any JSON object */
    const char *regex;       /* a regular expression the whole output matches */
    const char *grammar;     /* a context-free grammar in Lark syntax (llguidance's dialect) */

    /* Tools (chat only). tools_json is JSON text of the protocol's array of tool maps,
     * [{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}, ...]; the
     * library converts it to msgpack (a malformed text fails with KVD_ERR_INVALID_ARGUMENT, field "tools").
     * tool_choice is "none", "auto" or "required"; tool_choice_function instead forces a call to the function
     * of that name (set at most one of the two; neither: the daemon's default, "auto" with tools). */
    const char *tools_json;
    const char *tool_choice;
    const char *tool_choice_function;
    int parallel_tool_calls; /* -1 (kvd_request_init): the daemon's default, true; 0 or 1 */
} kvd_request;

KVD_API void kvd_request_init(kvd_request *request);

typedef struct kvd_usage {
    int64_t prompt_tokens;
    int64_t completion_tokens;
    int64_t cached_tokens; /* prompt tokens served from the prefix cache */
} kvd_usage;

/* A token's log-probability (of the model's raw distribution) and the best alternatives at its position. */
typedef struct kvd_top_logprob {
    int32_t token_id;
    double logprob;
} kvd_top_logprob;

typedef struct kvd_logprob {
    int32_t token_id; /* -1 for the first prompt token, which has no log-probability (logprob is NAN) */
    double logprob;
    kvd_top_logprob *top_logprobs; /* best first */
    size_t num_top_logprobs;
} kvd_logprob;

/* One increment of a streamed completion. The pointers are valid during the callback only. */
typedef struct kvd_chunk {
    uint64_t request_id;
    const char *text; /* NUL-terminated UTF-8, never a split character */
    size_t text_len;
    const int32_t *token_ids;
    size_t num_token_ids;
    const kvd_logprob *logprobs; /* one per token id when the request set logprobs, else NULL */
    int is_final; /* the last increment */
} kvd_chunk;

/* Return 0 to continue; anything else aborts the generation (it then ends with finish_reason "abort"). */
typedef int (*kvd_chunk_fn)(const kvd_chunk *chunk, void *user_data);

/* A whole generation. kvd_generate fills it (also on failure: error); release it with kvd_result_free. */
typedef struct kvd_result {
    uint64_t request_id;
    char *text; /* NUL-terminated; the concatenation of every chunk */
    size_t text_len;
    int32_t *token_ids;
    size_t num_token_ids;
    char finish_reason[16]; /* "stop", "length", "tool_calls" or "abort" */
    kvd_usage usage;
    kvd_logprob *logprobs; /* when the request set logprobs: one per token id (num_logprobs == num_token_ids) */
    size_t num_logprobs;
    kvd_logprob *prompt_logprobs; /* one per prompt token when the request set prompt_logprobs, else NULL */
    size_t num_prompt_logprobs;
    /* The calls the model made (a chat with tools); their text is not in `text`. The strings are owned by the
     * result, and the array may be passed as an assistant message's tool_calls in the next request. */
    kvd_tool_call *tool_calls;
    size_t num_tool_calls;
    kvd_error error; /* when kvd_generate did not return KVD_OK */
} kvd_result;

KVD_API void kvd_result_free(kvd_result *result);

typedef struct kvd_client kvd_client;

/* The endpoint kvd_connect would use, written to url: `endpoint` when not NULL or empty, else $KVD_ENDPOINT,
 * else ipc://$XDG_RUNTIME_DIR/kvd.sock, else ipc:///tmp/kvd-$UID/kvd.sock. It must be ipc://ABSOLUTE_PATH
 * (at most 107 bytes) or tcp://HOST:PORT. The last default is refused (KVD_ERR_ENDPOINT) when /tmp/kvd-$UID
 * exists but is a symbolic link, not a directory, another user's, or open to others: whoever created it could
 * listen there. `error` may be NULL. */
KVD_API kvd_status kvd_resolve_endpoint(const char *endpoint, char *url, size_t url_size, kvd_error *error);

/* Connect to the daemon at `endpoint` (NULL: the default, as kvd_resolve_endpoint). Connecting does not wait
 * for the daemon: a missing daemon is reported by the first call, after its timeout. */
KVD_API kvd_status kvd_connect(const char *endpoint, kvd_client **client, kvd_error *error);
KVD_API void kvd_close(kvd_client *client);
KVD_API const char *kvd_endpoint(const kvd_client *client);

/* How long a call waits while the daemon says nothing (default KVD_DEFAULT_TIMEOUT_MS). The daemon sends
 * heartbeats while a request is in flight, so a long generation never times out while the daemon lives. */
KVD_API kvd_status kvd_set_timeout(kvd_client *client, int timeout_ms);

/* Generate a completion, blocking until it ends. With on_chunk, the request streams: on_chunk gets each
 * increment as it is produced, in order, their concatenation being result->text; the last call has is_final
 * set (its increment may be empty). Returns KVD_OK when the generation ended (finish_reason says how, "abort"
 * included), or the error, described in result->error. On a timeout or a broken reply the request is aborted
 * in the daemon. An invalid schema, regex, grammar or tool is the daemon's KVD_ERR_BAD_REQUEST, error.field
 * naming it ("regex", "tools[0].function.parameters"). */
KVD_API kvd_status kvd_generate(kvd_client *client, const kvd_request *request, kvd_chunk_fn on_chunk,
                                void *user_data, kvd_result *result);

/* Ask for the abort of generation `request_id` (KVD_ABORT_CURRENT: whichever is in flight) of this client;
 * kvd_generate then returns with finish_reason "abort". Thread-safe and async-signal-safe: call it from
 * another thread, a signal handler or on_chunk. A request that is not in flight is left alone. */
KVD_API kvd_status kvd_abort(kvd_client *client, uint64_t request_id);

/* An embed request: set exactly one of texts and token_ids. Call kvd_embed_request_init first. */
typedef struct kvd_embed_request {
    const char *const *texts; /* num_inputs non-empty strings */
    const int32_t *const *token_ids; /* or num_inputs arrays of token ids, of num_token_ids[i] ids each */
    const size_t *num_token_ids;
    size_t num_inputs; /* 1..256 */
    int64_t dimensions; /* keep the first N components (re-normalised); KVD_UNSET: all (the hidden size) */
    const char *cache_salt;
} kvd_embed_request;

KVD_API void kvd_embed_request_init(kvd_embed_request *request);

/* Embedding vectors: num_vectors rows of `dimensions` floats, row-major (vector i is
 * data + i * dimensions), each L2-normalised, in the order of the inputs. Release with kvd_embeddings_free. */
typedef struct kvd_embeddings {
    float *data;
    size_t num_vectors;
    size_t dimensions;
    char pooling[16];      /* "mean" or "last" */
    int64_t prompt_tokens; /* all inputs together */
    kvd_error error;       /* when kvd_embed did not return KVD_OK */
} kvd_embeddings;

KVD_API void kvd_embeddings_free(kvd_embeddings *embeddings);

/* Embed the inputs, blocking until the vectors arrive. Fills `embeddings` (also on failure: error). */
KVD_API kvd_status kvd_embed(kvd_client *client, const kvd_embed_request *request, kvd_embeddings *embeddings);

/* The daemon's health: "ready" or "draining", written to status. */
KVD_API kvd_status kvd_health(kvd_client *client, char *status, size_t status_size, kvd_error *error);

#ifdef __cplusplus
}
#endif

#endif /* KVD_H */
