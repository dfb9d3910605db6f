/* kvd.c: the connection, the reply loop with its silence timeout, and the calls. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "internal.h"

#define MAX_ENDPOINT_BYTES 4096

struct kvd_client {
    void *context;
    void *socket;
    char endpoint[MAX_ENDPOINT_BYTES];
    int timeout_ms;
    uint64_t next_id;
    int64_t last_heard_ms; /* when the daemon last sent anything, heartbeats included */
    /* kvd_abort writes target ids into this pipe (write(2) is async-signal-safe); the reply loop, which owns
     * the socket, reads them and sends the abort. */
    int abort_pipe[2];
};

/* What the reply loop does with each reply of the request it waits for; sets *done when the request ended. */
typedef kvd_status (*reply_fn)(kvd_client *c, const kvd_reply *reply, void *ctx, int *done);

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void kvd_request_init(kvd_request *r) {
    memset(r, 0, sizeof *r);
    r->max_tokens = r->top_k = r->seed = KVD_UNSET;
    r->temperature = r->top_p = r->min_p = NAN;
    r->presence_penalty = r->frequency_penalty = r->repetition_penalty = NAN;
    r->logprobs = r->prompt_logprobs = KVD_UNSET;
    r->parallel_tool_calls = -1;
}

void kvd_embed_request_init(kvd_embed_request *r) {
    memset(r, 0, sizeof *r);
    r->dimensions = KVD_UNSET;
}

static void free_logprobs(kvd_logprob *logprobs, size_t n) {
    for (size_t i = 0; i < n; i++) free(logprobs[i].top_logprobs);
    free(logprobs);
}

void kvd_result_free(kvd_result *result) {
    if (result == NULL) return;
    free(result->text);
    free(result->token_ids);
    free_logprobs(result->logprobs, result->num_logprobs);
    free_logprobs(result->prompt_logprobs, result->num_prompt_logprobs);
    /* Each call's strings are one allocation, starting at id. */
    for (size_t i = 0; i < result->num_tool_calls; i++) free((char *)result->tool_calls[i].id);
    free(result->tool_calls);
    memset(result, 0, sizeof *result);
}

void kvd_embeddings_free(kvd_embeddings *embeddings) {
    if (embeddings == NULL) return;
    free(embeddings->data);
    memset(embeddings, 0, sizeof *embeddings);
}

const char *kvd_endpoint(const kvd_client *c) { return c->endpoint; }

kvd_status kvd_set_timeout(kvd_client *c, int timeout_ms) {
    if (c == NULL || timeout_ms <= 0) return KVD_ERR_INVALID_ARGUMENT;
    c->timeout_ms = timeout_ms;
    return KVD_OK;
}

static int make_abort_pipe(int fds[2]) {
    if (pipe(fds) != 0) return -1;
    for (int i = 0; i < 2; i++) {
        /* Non-blocking: a signal handler must never block on a full pipe, the loop drains it. */
        if (fcntl(fds[i], F_SETFL, O_NONBLOCK) != 0 || fcntl(fds[i], F_SETFD, FD_CLOEXEC) != 0) {
            close(fds[0]);
            close(fds[1]);
            return -1;
        }
    }
    return 0;
}

kvd_status kvd_connect(const char *endpoint, kvd_client **out, kvd_error *error) {
    if (out == NULL) return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_connect: client must not be NULL");
    *out = NULL;
    kvd_client *c = calloc(1, sizeof *c);
    if (c == NULL) return kvd_fail(error, KVD_ERR_NO_MEMORY, "out of memory");
    kvd_status status = kvd_resolve_endpoint(endpoint, c->endpoint, sizeof c->endpoint, error);
    if (status != KVD_OK) {
        free(c);
        return status;
    }
    c->timeout_ms = KVD_DEFAULT_TIMEOUT_MS;
    c->next_id = 1;
    if (make_abort_pipe(c->abort_pipe) != 0) {
        free(c);
        return kvd_fail(error, KVD_ERR_NO_MEMORY, "kvd_connect: cannot create a pipe: %s", strerror(errno));
    }
    /* IPv6 mode for an IPv6 address only: with it libzmq resolves localhost to ::1, where a daemon that bound
     * localhost (in IPv4, as it does) is not. */
    int zero = 0, ipv6 = kvd_endpoint_is_ipv6(c->endpoint);
    c->context = zmq_ctx_new();
    c->socket = c->context ? zmq_socket(c->context, ZMQ_DEALER) : NULL;
    if (c->socket == NULL || zmq_setsockopt(c->socket, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_setsockopt(c->socket, ZMQ_IPV6, &ipv6, sizeof ipv6) != 0) {
        status = kvd_fail(error, KVD_ERR_ZMQ, "cannot create a ZeroMQ socket: %s", zmq_strerror(zmq_errno()));
    } else if (zmq_connect(c->socket, c->endpoint) != 0) {
        status = kvd_fail(error, KVD_ERR_ENDPOINT, "cannot connect to %s: %s", c->endpoint,
                          zmq_strerror(zmq_errno()));
    }
    if (status != KVD_OK) {
        kvd_close(c);
        return status;
    }
    *out = c;
    return KVD_OK;
}

void kvd_close(kvd_client *c) {
    if (c == NULL) return;
    if (c->socket) zmq_close(c->socket);
    if (c->context) zmq_ctx_term(c->context);
    close(c->abort_pipe[0]);
    close(c->abort_pipe[1]);
    free(c);
}

kvd_status kvd_abort(kvd_client *c, uint64_t request_id) {
    if (c == NULL) return KVD_ERR_INVALID_ARGUMENT;
    /* A full pipe already holds thousands of aborts: dropping one more loses nothing. */
    ssize_t written = write(c->abort_pipe[1], &request_id, sizeof request_id);
    (void)written;
    return KVD_OK;
}

/* The ids kvd_abort asked for since the last call: does one of them target `rid`? */
static int abort_requested(kvd_client *c, uint64_t rid) {
    int hit = 0;
    uint64_t id;
    while (read(c->abort_pipe[0], &id, sizeof id) == (ssize_t)sizeof id)
        if (rid != 0 && (id == rid || id == KVD_ABORT_CURRENT)) hit = 1;
    return hit;
}

static kvd_status timeout_error(const kvd_client *c, kvd_error *error) {
    struct stat st;
    if (strncmp(c->endpoint, "ipc://", 6) == 0 && stat(c->endpoint + 6, &st) != 0 && errno == ENOENT)
        return kvd_fail(error, KVD_ERR_NO_DAEMON,
                        "no kvd daemon at %s: the socket file does not exist after %g s; start `kvd serve` "
                        "(or choose the endpoint: kvd_connect(endpoint, ...) or $KVD_ENDPOINT)",
                        c->endpoint, c->timeout_ms / 1000.0);
    return kvd_fail(error, KVD_ERR_TIMEOUT,
                    "no reply from the kvd daemon at %s within %g s: is `kvd serve` running there? (choose the "
                    "endpoint: kvd_connect(endpoint, ...) or $KVD_ENDPOINT)",
                    c->endpoint, c->timeout_ms / 1000.0);
}

static kvd_status send_message(kvd_client *c, const msgpack_sbuffer *message, kvd_error *error) {
    int64_t started = now_ms();
    while (zmq_send(c->socket, message->data, message->size, ZMQ_DONTWAIT) < 0) {
        int err = zmq_errno();
        if (err != EAGAIN && err != EINTR)
            return kvd_fail(error, KVD_ERR_ZMQ, "cannot send to %s: %s", c->endpoint, zmq_strerror(err));
        /* The outgoing queue is full: the daemon has not been reading (or never connected). */
        int64_t left = c->timeout_ms - (now_ms() - started);
        if (left <= 0) return timeout_error(c, error);
        zmq_pollitem_t item = {c->socket, 0, ZMQ_POLLOUT, 0};
        if (zmq_poll(&item, 1, (long)left) < 0 && zmq_errno() != EINTR)
            return kvd_fail(error, KVD_ERR_ZMQ, "zmq_poll: %s", zmq_strerror(zmq_errno()));
    }
    return KVD_OK;
}

static kvd_status send_packed(kvd_client *c, int packed, msgpack_sbuffer *message, kvd_error *error) {
    kvd_status status = packed == 0 ? send_message(c, message, error)
                                    : kvd_fail(error, KVD_ERR_NO_MEMORY, "out of memory encoding a request");
    msgpack_sbuffer_destroy(message);
    return status;
}

/* Best effort: a daemon that cannot take the abort cannot take anything else either. */
static void abort_quietly(kvd_client *c, uint64_t target) {
    msgpack_sbuffer message;
    msgpack_sbuffer_init(&message);
    if (kvd_pack_abort(&message, c->next_id++, target) == 0)
        zmq_send(c->socket, message.data, message.size, ZMQ_DONTWAIT);
    msgpack_sbuffer_destroy(&message);
}

/* Read every reply that has arrived; hand those of `rid` to on_reply. */
static kvd_status receive_ready(kvd_client *c, uint64_t rid, reply_fn on_reply, void *ctx, int *done,
                                kvd_error *error) {
    while (!*done) {
        zmq_msg_t frame;
        zmq_msg_init(&frame);
        if (zmq_msg_recv(&frame, c->socket, ZMQ_DONTWAIT) < 0) {
            int err = zmq_errno();
            zmq_msg_close(&frame);
            if (err == EAGAIN || err == EINTR) return KVD_OK;
            return kvd_fail(error, KVD_ERR_ZMQ, "cannot receive from %s: %s", c->endpoint, zmq_strerror(err));
        }
        c->last_heard_ms = now_ms();
        kvd_reply reply;
        kvd_status status = kvd_decode_reply(zmq_msg_data(&frame), zmq_msg_size(&frame), &reply, error);
        /* An id-less error answers a message the daemon could not read: with one request in flight, ours.
         * Other ids are late replies of abandoned requests and the results of aborts: nothing waits for them. */
        int ours = status == KVD_OK && ((reply.id_kind == KVD_ID_INT && reply.id == rid) ||
                                        (reply.id_kind == KVD_ID_NIL && kvd_reply_is(&reply, "error")));
        if (ours) status = on_reply(c, &reply, ctx, done);
        kvd_reply_destroy(&reply);
        zmq_msg_close(&frame);
        if (status != KVD_OK) return status;
    }
    return KVD_OK;
}

/* Wait for the replies of `rid` until on_reply says it is done, or until the daemon is silent for the
 * timeout. When `abortable`, kvd_abort requests for rid are forwarded to the daemon. */
static kvd_status wait_for(kvd_client *c, uint64_t rid, int abortable, reply_fn on_reply, void *ctx,
                           kvd_error *error) {
    int64_t started = now_ms();
    int done = 0, abort_sent = 0;
    while (!done) {
        int64_t heard = c->last_heard_ms > started ? c->last_heard_ms : started;
        int64_t quiet = now_ms() - heard;
        if (quiet >= c->timeout_ms) return timeout_error(c, error);
        zmq_pollitem_t items[2] = {{c->socket, 0, ZMQ_POLLIN, 0}, {NULL, c->abort_pipe[0], ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, (long)(c->timeout_ms - quiet)) < 0) {
            if (zmq_errno() == EINTR) continue; /* a signal: its handler may have called kvd_abort */
            return kvd_fail(error, KVD_ERR_ZMQ, "zmq_poll: %s", zmq_strerror(zmq_errno()));
        }
        if ((items[1].revents & ZMQ_POLLIN) && abort_requested(c, abortable ? rid : 0) && !abort_sent) {
            abort_quietly(c, rid);
            abort_sent = 1;
        }
        if (items[0].revents & ZMQ_POLLIN) {
            kvd_status status = receive_ready(c, rid, on_reply, ctx, &done, error);
            if (status != KVD_OK) return status;
        }
    }
    return KVD_OK;
}

/* The state of one kvd_generate. */
typedef struct generation {
    kvd_result *result;
    size_t text_cap, ids_cap, logprobs_cap;
    kvd_chunk_fn on_chunk;
    void *user_data;
    int stopped; /* on_chunk asked to stop: the abort is sent, no more calls */
} generation;

static int grow(void **buf, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *p = realloc(*buf, cap2 * item);
    if (p == NULL) return -1;
    *buf = p;
    *cap = cap2;
    return 0;
}

/* One logprobs entry, {"token_id", "logprob", "top_logprobs": [[id, logprob], ...]}, or nil (the first prompt
 * token). On success `out` owns its top_logprobs. */
static kvd_status read_logprob(const msgpack_object *o, kvd_logprob *out, kvd_error *error) {
    memset(out, 0, sizeof *out);
    if (o->type == MSGPACK_OBJECT_NIL) {
        out->token_id = -1;
        out->logprob = NAN;
        return KVD_OK;
    }
    const msgpack_object *id = kvd_map_get(o, "token_id");
    const msgpack_object *top = kvd_map_get(o, "top_logprobs");
    if (id == NULL || id->type != MSGPACK_OBJECT_POSITIVE_INTEGER || id->via.u64 > INT32_MAX ||
        kvd_object_number(kvd_map_get(o, "logprob"), &out->logprob) != 0 ||
        (top != NULL && top->type != MSGPACK_OBJECT_ARRAY && top->type != MSGPACK_OBJECT_NIL))
        return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon sent a malformed logprobs entry");
    out->token_id = (int32_t)id->via.u64;
    if (top == NULL || top->type != MSGPACK_OBJECT_ARRAY || top->via.array.size == 0) return KVD_OK;
    size_t n = top->via.array.size;
    kvd_top_logprob *alts = malloc(n * sizeof *alts);
    if (alts == NULL) return kvd_fail(error, KVD_ERR_NO_MEMORY, "out of memory holding log-probabilities");
    for (size_t i = 0; i < n; i++) {
        const msgpack_object *pair = &top->via.array.ptr[i];
        const msgpack_object *items = pair->type == MSGPACK_OBJECT_ARRAY ? pair->via.array.ptr : NULL;
        if (items == NULL || pair->via.array.size != 2 || items[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            items[0].via.u64 > INT32_MAX || kvd_object_number(&items[1], &alts[i].logprob) != 0) {
            free(alts);
            return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon sent a malformed top_logprobs entry");
        }
        alts[i].token_id = (int32_t)items[0].via.u64;
    }
    out->top_logprobs = alts;
    out->num_top_logprobs = n;
    return KVD_OK;
}

/* Append the entries of a logprobs array to *list (growing it; *num counts the entries that are whole). */
static kvd_status append_logprobs(const msgpack_object *array, kvd_logprob **list, size_t *num, size_t *cap,
                                  kvd_error *error) {
    size_t n = array->via.array.size;
    if (grow((void **)list, cap, *num + n, sizeof **list) != 0)
        return kvd_fail(error, KVD_ERR_NO_MEMORY, "out of memory holding log-probabilities");
    for (size_t i = 0; i < n; i++) {
        kvd_status status = read_logprob(&array->via.array.ptr[i], &(*list)[*num], error);
        if (status != KVD_OK) return status;
        (*num)++;
    }
    return KVD_OK;
}

/* Append a chunk or final reply's increment to the result; the chunk view points into the result. */
static kvd_status append_increment(generation *g, const kvd_reply *reply, kvd_chunk *chunk) {
    kvd_result *r = g->result;
    const char *text;
    size_t len;
    kvd_status status = kvd_reply_str(reply, "text", &text, &len, &r->error);
    if (status != KVD_OK) return status;
    const msgpack_object *ids = kvd_reply_get(reply, "token_ids");
    if (ids == NULL || ids->type != MSGPACK_OBJECT_ARRAY)
        return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent a chunk without token_ids");
    size_t n = ids->via.array.size;
    if (grow((void **)&r->text, &g->text_cap, r->text_len + len + 1, 1) != 0 ||
        grow((void **)&r->token_ids, &g->ids_cap, r->num_token_ids + n, sizeof(int32_t)) != 0)
        return kvd_fail(&r->error, KVD_ERR_NO_MEMORY, "out of memory holding the completion");
    memset(chunk, 0, sizeof *chunk);
    chunk->request_id = r->request_id;
    chunk->text = r->text + r->text_len;
    chunk->text_len = len;
    chunk->token_ids = r->token_ids + r->num_token_ids;
    chunk->num_token_ids = n;
    memcpy(r->text + r->text_len, text, len);
    r->text_len += len;
    r->text[r->text_len] = '\0';
    for (size_t i = 0; i < n; i++) {
        const msgpack_object *id = &ids->via.array.ptr[i];
        if (id->type != MSGPACK_OBJECT_POSITIVE_INTEGER || id->via.u64 > INT32_MAX)
            return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent a token id that is not an int32");
        r->token_ids[r->num_token_ids++] = (int32_t)id->via.u64;
    }
    const msgpack_object *logprobs = kvd_reply_get(reply, "logprobs");
    if (logprobs == NULL || logprobs->type == MSGPACK_OBJECT_NIL) {
        if (n > 0 && r->num_logprobs > 0)
            return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent tokens without their logprobs");
        return KVD_OK;
    }
    size_t before = r->num_logprobs;
    if (logprobs->type != MSGPACK_OBJECT_ARRAY || logprobs->via.array.size != n ||
        before + n != r->num_token_ids)
        return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent logprobs that do not match the tokens");
    kvd_status lp = append_logprobs(logprobs, &r->logprobs, &r->num_logprobs, &g->logprobs_cap, &r->error);
    if (lp != KVD_OK) return lp;
    chunk->logprobs = r->logprobs + before;
    return KVD_OK;
}

/* The final's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}, ...]. */
static kvd_status read_tool_calls(kvd_result *r, const msgpack_object *calls) {
    if (calls == NULL || calls->type == MSGPACK_OBJECT_NIL) return KVD_OK;
    if (calls->type != MSGPACK_OBJECT_ARRAY)
        return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent tool_calls that are not an array");
    size_t n = calls->via.array.size;
    if (n == 0) return KVD_OK;
    r->tool_calls = calloc(n, sizeof *r->tool_calls);
    if (r->tool_calls == NULL) return kvd_fail(&r->error, KVD_ERR_NO_MEMORY, "out of memory holding tool calls");
    for (size_t i = 0; i < n; i++) {
        const msgpack_object *call = &calls->via.array.ptr[i];
        const msgpack_object *function = kvd_map_get(call, "function");
        const msgpack_object *parts[3] = {kvd_map_get(call, "id"), kvd_map_get(function, "name"),
                                          kvd_map_get(function, "arguments")};
        size_t size = 0;
        for (int k = 0; k < 3; k++) {
            if (parts[k] == NULL || parts[k]->type != MSGPACK_OBJECT_STR)
                return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent a malformed tool call");
            size += parts[k]->via.str.size + 1;
        }
        char *block = malloc(size);
        if (block == NULL) return kvd_fail(&r->error, KVD_ERR_NO_MEMORY, "out of memory holding tool calls");
        const char **fields[3] = {&r->tool_calls[i].id, &r->tool_calls[i].name, &r->tool_calls[i].arguments};
        char *at = block;
        for (int k = 0; k < 3; k++) {
            memcpy(at, parts[k]->via.str.ptr, parts[k]->via.str.size);
            at[parts[k]->via.str.size] = '\0';
            *fields[k] = at;
            at += parts[k]->via.str.size + 1;
        }
        r->num_tool_calls++;
    }
    return KVD_OK;
}

static kvd_status read_final(kvd_result *r, const kvd_reply *reply) {
    const char *reason;
    size_t len;
    kvd_status status = kvd_reply_str(reply, "finish_reason", &reason, &len, &r->error);
    if (status != KVD_OK) return status;
    snprintf(r->finish_reason, sizeof r->finish_reason, "%.*s", (int)len, reason);
    const msgpack_object *usage = kvd_reply_get(reply, "usage");
    if (usage == NULL || usage->type != MSGPACK_OBJECT_MAP)
        return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent a final reply without usage");
    if ((status = kvd_reply_int(reply, usage, "prompt_tokens", &r->usage.prompt_tokens, &r->error)) != KVD_OK ||
        (status = kvd_reply_int(reply, usage, "completion_tokens", &r->usage.completion_tokens, &r->error)) !=
            KVD_OK ||
        (status = kvd_reply_int(reply, usage, "cached_tokens", &r->usage.cached_tokens, &r->error)) != KVD_OK)
        return status;
    if ((status = read_tool_calls(r, kvd_reply_get(reply, "tool_calls"))) != KVD_OK) return status;
    const msgpack_object *prompt = kvd_reply_get(reply, "prompt_logprobs");
    if (prompt == NULL || prompt->type == MSGPACK_OBJECT_NIL) return KVD_OK;
    if (prompt->type != MSGPACK_OBJECT_ARRAY)
        return kvd_fail(&r->error, KVD_ERR_PROTOCOL, "the daemon sent prompt_logprobs that are not an array");
    size_t cap = 0;
    return append_logprobs(prompt, &r->prompt_logprobs, &r->num_prompt_logprobs, &cap, &r->error);
}

static kvd_status on_generation_reply(kvd_client *c, const kvd_reply *reply, void *ctx, int *done) {
    generation *g = ctx;
    if (kvd_reply_is(reply, "error")) {
        *done = 1;
        return kvd_reply_error(reply, &g->result->error);
    }
    int final = kvd_reply_is(reply, "final");
    if (!final && !kvd_reply_is(reply, "chunk"))
        return kvd_fail(&g->result->error, KVD_ERR_PROTOCOL, "expected a chunk or final reply, got '%.*s'",
                        (int)reply->type_len, reply->type);
    kvd_chunk chunk;
    kvd_status status = append_increment(g, reply, &chunk);
    if (status == KVD_OK && final) status = read_final(g->result, reply);
    if (status != KVD_OK) return status;
    chunk.is_final = final;
    if (g->on_chunk != NULL && !g->stopped && (chunk.text_len > 0 || chunk.num_token_ids > 0 || final) &&
        g->on_chunk(&chunk, g->user_data) != 0 && !final) {
        g->stopped = 1;
        abort_quietly(c, g->result->request_id);
    }
    *done = final;
    return KVD_OK;
}

/* What the library would otherwise pack from a NULL pointer; the daemon checks everything else. */
static kvd_status check_request(const kvd_request *r, kvd_error *error) {
    for (size_t i = 0; r->messages != NULL && i < r->num_messages; i++) {
        const kvd_message *m = &r->messages[i];
        if (m->role == NULL)
            return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_generate: messages[%zu].role is NULL", i);
        for (size_t j = 0; m->tool_calls != NULL && j < m->num_tool_calls; j++) {
            const kvd_tool_call *call = &m->tool_calls[j];
            if (call->id == NULL || call->name == NULL || call->arguments == NULL)
                return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT,
                                "kvd_generate: messages[%zu].tool_calls[%zu] needs id, name and arguments", i, j);
        }
    }
    for (size_t i = 0; r->stop != NULL && i < r->num_stop; i++)
        if (r->stop[i] == NULL) return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_generate: stop[%zu] is NULL", i);
    if (r->tool_choice != NULL && r->tool_choice_function != NULL)
        return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT,
                        "kvd_generate: set at most one of tool_choice and tool_choice_function");
    return KVD_OK;
}

kvd_status kvd_generate(kvd_client *c, const kvd_request *request, kvd_chunk_fn on_chunk, void *user_data,
                        kvd_result *result) {
    if (result == NULL) return KVD_ERR_INVALID_ARGUMENT;
    memset(result, 0, sizeof *result);
    if (c == NULL || request == NULL)
        return kvd_fail(&result->error, KVD_ERR_INVALID_ARGUMENT, "kvd_generate: client and request are required");
    int inputs = (request->prompt != NULL) + (request->prompt_token_ids != NULL) + (request->messages != NULL);
    if (inputs != 1)
        return kvd_fail(&result->error, KVD_ERR_INVALID_ARGUMENT,
                        "kvd_generate: set exactly one of prompt, prompt_token_ids and messages (%d set)", inputs);
    kvd_status status = check_request(request, &result->error);
    if (status != KVD_OK) return status;
    msgpack_sbuffer tools;
    msgpack_sbuffer_init(&tools);
    if (request->tools_json != NULL &&
        (status = kvd_json_to_msgpack(request->tools_json, &tools, "tools", &result->error)) != KVD_OK) {
        msgpack_sbuffer_destroy(&tools);
        return status;
    }
    abort_requested(c, 0); /* forget aborts asked for while nothing was in flight */
    result->request_id = c->next_id++;
    msgpack_sbuffer message;
    msgpack_sbuffer_init(&message);
    int packed = kvd_pack_generate(&message, result->request_id, request, on_chunk != NULL,
                                   request->tools_json != NULL ? &tools : NULL);
    msgpack_sbuffer_destroy(&tools);
    status = send_packed(c, packed, &message, &result->error);
    if (status != KVD_OK) return status;
    generation g = {.result = result, .on_chunk = on_chunk, .user_data = user_data};
    status = wait_for(c, result->request_id, 1, on_generation_reply, &g, &result->error);
    if (status != KVD_OK && status >= KVD_ERR_NO_DAEMON)
        abort_quietly(c, result->request_id); /* timed out or broken: do not leave the daemon generating */
    return status;
}

typedef struct health_call {
    char *status;
    size_t size;
    kvd_error *error;
} health_call;

static kvd_status on_health_reply(kvd_client *c, const kvd_reply *reply, void *ctx, int *done) {
    (void)c;
    health_call *h = ctx;
    *done = 1;
    if (kvd_reply_is(reply, "error")) return kvd_reply_error(reply, h->error);
    const char *status;
    size_t len;
    if (!kvd_reply_is(reply, "result") || kvd_reply_str(reply, "status", &status, &len, h->error) != KVD_OK)
        return kvd_fail(h->error, KVD_ERR_PROTOCOL, "the daemon's health reply has no status");
    snprintf(h->status, h->size, "%.*s", (int)len, status);
    return KVD_OK;
}

kvd_status kvd_health(kvd_client *c, char *status, size_t status_size, kvd_error *error) {
    if (c == NULL || status == NULL || status_size == 0)
        return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_health: client and status are required");
    uint64_t rid = c->next_id++;
    msgpack_sbuffer message;
    msgpack_sbuffer_init(&message);
    int packed = kvd_pack_op(&message, rid, "health");
    kvd_status result = send_packed(c, packed, &message, error);
    if (result != KVD_OK) return result;
    health_call h = {status, status_size, error};
    return wait_for(c, rid, 0, on_health_reply, &h, error);
}

/* The state of one kvd_embed. */
typedef struct embed_call {
    kvd_embeddings *out;
} embed_call;

static kvd_status on_embed_reply(kvd_client *c, const kvd_reply *reply, void *ctx, int *done) {
    (void)c;
    kvd_embeddings *e = ((embed_call *)ctx)->out;
    *done = 1;
    if (kvd_reply_is(reply, "error")) return kvd_reply_error(reply, &e->error);
    if (!kvd_reply_is(reply, "result"))
        return kvd_fail(&e->error, KVD_ERR_PROTOCOL, "expected a result reply, got '%.*s'", (int)reply->type_len,
                        reply->type);
    const msgpack_object *vectors = kvd_reply_get(reply, "embeddings");
    int64_t dims;
    kvd_status status = kvd_reply_int(reply, reply->map, "dimensions", &dims, &e->error);
    if (status != KVD_OK) return status;
    if (vectors == NULL || vectors->type != MSGPACK_OBJECT_ARRAY || dims <= 0)
        return kvd_fail(&e->error, KVD_ERR_PROTOCOL, "the daemon's embed result has no embeddings");
    size_t n = vectors->via.array.size, d = (size_t)dims;
    if (n > 0 && d > SIZE_MAX / sizeof(float) / n)
        return kvd_fail(&e->error, KVD_ERR_PROTOCOL, "the daemon sent an absurd number of dimensions");
    e->data = malloc((n ? n : 1) * d * sizeof(float));
    if (e->data == NULL) return kvd_fail(&e->error, KVD_ERR_NO_MEMORY, "out of memory holding the embeddings");
    for (size_t i = 0; i < n; i++) {
        const msgpack_object *v = &vectors->via.array.ptr[i];
        if (v->type != MSGPACK_OBJECT_ARRAY || v->via.array.size != d)
            return kvd_fail(&e->error, KVD_ERR_PROTOCOL, "the daemon sent embedding %zu with the wrong length", i);
        for (size_t j = 0; j < d; j++) {
            double x;
            if (kvd_object_number(&v->via.array.ptr[j], &x) != 0)
                return kvd_fail(&e->error, KVD_ERR_PROTOCOL, "the daemon sent an embedding that is not numbers");
            e->data[i * d + j] = (float)x;
        }
    }
    e->num_vectors = n;
    e->dimensions = d;
    const char *pooling;
    size_t len;
    if (kvd_reply_str(reply, "pooling", &pooling, &len, NULL) == KVD_OK)
        snprintf(e->pooling, sizeof e->pooling, "%.*s", (int)len, pooling);
    const msgpack_object *usage = kvd_reply_get(reply, "usage");
    if (usage != NULL && usage->type == MSGPACK_OBJECT_MAP)
        return kvd_reply_int(reply, usage, "prompt_tokens", &e->prompt_tokens, &e->error);
    return kvd_fail(&e->error, KVD_ERR_PROTOCOL, "the daemon's embed result has no usage");
}

kvd_status kvd_embed(kvd_client *c, const kvd_embed_request *request, kvd_embeddings *embeddings) {
    if (embeddings == NULL) return KVD_ERR_INVALID_ARGUMENT;
    memset(embeddings, 0, sizeof *embeddings);
    kvd_error *error = &embeddings->error;
    if (c == NULL || request == NULL)
        return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_embed: client and request are required");
    if ((request->texts != NULL) == (request->token_ids != NULL) || request->num_inputs == 0)
        return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT,
                        "kvd_embed: set exactly one of texts and token_ids, and num_inputs > 0");
    for (size_t i = 0; i < request->num_inputs; i++) {
        int missing = request->texts != NULL ? request->texts[i] == NULL
                                             : request->token_ids[i] == NULL || request->num_token_ids == NULL;
        if (missing) return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_embed: input %zu is NULL", i);
    }
    uint64_t rid = c->next_id++;
    msgpack_sbuffer message;
    msgpack_sbuffer_init(&message);
    int packed = kvd_pack_embed(&message, rid, request);
    kvd_status status = send_packed(c, packed, &message, error);
    if (status != KVD_OK) return status;
    embed_call call = {embeddings};
    status = wait_for(c, rid, 0, on_embed_reply, &call, error);
    if (status != KVD_OK) {
        free(embeddings->data);
        embeddings->data = NULL;
        embeddings->num_vectors = embeddings->dimensions = 0;
    }
    return status;
}
