/* wire.c: request maps out, reply maps in (msgpack, one map per ZeroMQ frame). */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* The fields of one request, packed as they come; the map header (which needs the count) goes first later. */
typedef struct fields {
    msgpack_sbuffer body;
    msgpack_packer pk;
    uint32_t count;
    int failed;
} fields;

static void fields_init(fields *f) {
    msgpack_sbuffer_init(&f->body);
    msgpack_packer_init(&f->pk, &f->body, msgpack_sbuffer_write);
    f->count = 0;
    f->failed = 0;
}

static void pack_cstr(fields *f, const char *s) {
    f->failed |= msgpack_pack_str_with_body(&f->pk, s, strlen(s)) != 0;
}

static void key(fields *f, const char *name) {
    pack_cstr(f, name);
    f->count++;
}

static void put_str(fields *f, const char *name, const char *value) {
    key(f, name);
    pack_cstr(f, value);
}

static void put_int(fields *f, const char *name, int64_t value) {
    key(f, name);
    f->failed |= msgpack_pack_int64(&f->pk, value) != 0;
}

static void put_uint(fields *f, const char *name, uint64_t value) {
    key(f, name);
    f->failed |= msgpack_pack_uint64(&f->pk, value) != 0;
}

static void put_double(fields *f, const char *name, double value) {
    key(f, name);
    f->failed |= msgpack_pack_double(&f->pk, value) != 0;
}

static void put_true(fields *f, const char *name) {
    key(f, name);
    f->failed |= msgpack_pack_true(&f->pk) != 0;
}

static void put_ids(fields *f, const char *name, const int32_t *ids, size_t n) {
    key(f, name);
    f->failed |= msgpack_pack_array(&f->pk, n) != 0;
    for (size_t i = 0; i < n; i++) f->failed |= msgpack_pack_int32(&f->pk, ids[i]) != 0;
}

static void put_strs(fields *f, const char *name, const char *const *strs, size_t n) {
    key(f, name);
    f->failed |= msgpack_pack_array(&f->pk, n) != 0;
    for (size_t i = 0; i < n; i++) pack_cstr(f, strs[i]);
}

static void pack_opt_cstr(fields *f, const char *s) {
    if (s != NULL) pack_cstr(f, s);
    else f->failed |= msgpack_pack_nil(&f->pk) != 0;
}

static void pack_tool_call(fields *f, const kvd_tool_call *call) {
    f->failed |= msgpack_pack_map(&f->pk, 3) != 0;
    pack_cstr(f, "id");
    pack_cstr(f, call->id);
    pack_cstr(f, "type");
    pack_cstr(f, "function");
    pack_cstr(f, "function");
    f->failed |= msgpack_pack_map(&f->pk, 2) != 0;
    pack_cstr(f, "name");
    pack_cstr(f, call->name);
    pack_cstr(f, "arguments");
    pack_cstr(f, call->arguments);
}

static void put_messages(fields *f, const kvd_message *messages, size_t n) {
    key(f, "messages");
    f->failed |= msgpack_pack_array(&f->pk, n) != 0;
    for (size_t i = 0; i < n; i++) {
        const kvd_message *m = &messages[i];
        uint32_t count = 2 + (m->tool_calls != NULL) + (m->tool_call_id != NULL) + (m->name != NULL);
        f->failed |= msgpack_pack_map(&f->pk, count) != 0;
        pack_cstr(f, "role");
        pack_cstr(f, m->role);
        pack_cstr(f, "content");
        pack_opt_cstr(f, m->content);
        if (m->tool_calls != NULL) {
            pack_cstr(f, "tool_calls");
            f->failed |= msgpack_pack_array(&f->pk, m->num_tool_calls) != 0;
            for (size_t j = 0; j < m->num_tool_calls; j++) pack_tool_call(f, &m->tool_calls[j]);
        }
        if (m->tool_call_id != NULL) {
            pack_cstr(f, "tool_call_id");
            pack_cstr(f, m->tool_call_id);
        }
        if (m->name != NULL) {
            pack_cstr(f, "name");
            pack_cstr(f, m->name);
        }
    }
}

static void put_logit_bias(fields *f, const kvd_logit_bias *bias, size_t n) {
    key(f, "logit_bias");
    f->failed |= msgpack_pack_map(&f->pk, n) != 0;
    for (size_t i = 0; i < n; i++) {
        char id[16];
        snprintf(id, sizeof id, "%d", (int)bias[i].token_id); /* the protocol's keys: ids in decimal */
        pack_cstr(f, id);
        f->failed |= msgpack_pack_double(&f->pk, bias[i].bias) != 0;
    }
}

static void put_packed(fields *f, const char *name, const msgpack_sbuffer *value) {
    key(f, name);
    f->failed |= msgpack_sbuffer_write(&f->body, value->data, value->size) != 0;
}

static void put_tool_choice(fields *f, const kvd_request *r) {
    if (r->tool_choice != NULL) {
        put_str(f, "tool_choice", r->tool_choice);
    } else if (r->tool_choice_function != NULL) {
        key(f, "tool_choice");
        f->failed |= msgpack_pack_map(&f->pk, 2) != 0;
        pack_cstr(f, "type");
        pack_cstr(f, "function");
        pack_cstr(f, "function");
        f->failed |= msgpack_pack_map(&f->pk, 1) != 0;
        pack_cstr(f, "name");
        pack_cstr(f, r->tool_choice_function);
    }
}

static void put_header(fields *f, uint64_t id, const char *op) {
    put_int(f, "v", KVD_PROTOCOL_VERSION);
    put_uint(f, "id", id);
    put_str(f, "op", op);
}

/* out = map header + the packed fields; releases f. */
static int finish(fields *f, msgpack_sbuffer *out) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, out, msgpack_sbuffer_write);
    int failed = f->failed || msgpack_pack_map(&pk, f->count) != 0 ||
                 msgpack_sbuffer_write(out, f->body.data, f->body.size) != 0;
    msgpack_sbuffer_destroy(&f->body);
    return failed ? -1 : 0;
}

int kvd_pack_generate(msgpack_sbuffer *out, uint64_t id, const kvd_request *r, int stream,
                      const msgpack_sbuffer *tools) {
    fields f;
    fields_init(&f);
    put_header(&f, id, r->messages != NULL ? "chat" : "generate");
    if (r->prompt != NULL) put_str(&f, "prompt", r->prompt);
    if (r->prompt_token_ids != NULL) put_ids(&f, "prompt_token_ids", r->prompt_token_ids, r->num_prompt_token_ids);
    if (r->messages != NULL) put_messages(&f, r->messages, r->num_messages);
    if (stream) put_true(&f, "stream");
    if (r->max_tokens != KVD_UNSET) put_int(&f, "max_tokens", r->max_tokens);
    if (!isnan(r->temperature)) put_double(&f, "temperature", r->temperature);
    if (!isnan(r->top_p)) put_double(&f, "top_p", r->top_p);
    if (r->top_k != KVD_UNSET) put_int(&f, "top_k", r->top_k);
    if (!isnan(r->min_p)) put_double(&f, "min_p", r->min_p);
    if (r->seed != KVD_UNSET) put_int(&f, "seed", r->seed);
    if (r->stop != NULL) put_strs(&f, "stop", r->stop, r->num_stop);
    if (r->stop_token_ids != NULL) put_ids(&f, "stop_token_ids", r->stop_token_ids, r->num_stop_token_ids);
    if (r->ignore_eos) put_true(&f, "ignore_eos");
    if (!isnan(r->presence_penalty)) put_double(&f, "presence_penalty", r->presence_penalty);
    if (!isnan(r->frequency_penalty)) put_double(&f, "frequency_penalty", r->frequency_penalty);
    if (!isnan(r->repetition_penalty)) put_double(&f, "repetition_penalty", r->repetition_penalty);
    if (r->cache_salt != NULL) put_str(&f, "cache_salt", r->cache_salt);
    if (r->logit_bias != NULL) put_logit_bias(&f, r->logit_bias, r->num_logit_bias);
    if (r->logprobs != KVD_UNSET) put_int(&f, "logprobs", r->logprobs);
    if (r->prompt_logprobs != KVD_UNSET) put_int(&f, "prompt_logprobs", r->prompt_logprobs);
    if (r->json_schema != NULL) put_str(&f, "json_schema", r->json_schema); /* JSON text: the protocol takes it */
    if (r->json_object) put_true(&f, "json_object");
    if (r->regex != NULL) put_str(&f, "regex", r->regex);
    if (r->grammar != NULL) put_str(&f, "grammar", r->grammar);
    if (tools != NULL) put_packed(&f, "tools", tools);
    put_tool_choice(&f, r);
    if (r->parallel_tool_calls >= 0) {
        key(&f, "parallel_tool_calls");
        f.failed |= (r->parallel_tool_calls ? msgpack_pack_true(&f.pk) : msgpack_pack_false(&f.pk)) != 0;
    }
    return finish(&f, out);
}

int kvd_pack_embed(msgpack_sbuffer *out, uint64_t id, const kvd_embed_request *r) {
    fields f;
    fields_init(&f);
    put_header(&f, id, "embed");
    key(&f, "input");
    f.failed |= msgpack_pack_array(&f.pk, r->num_inputs) != 0;
    for (size_t i = 0; i < r->num_inputs; i++) {
        if (r->texts != NULL) {
            pack_cstr(&f, r->texts[i]);
            continue;
        }
        f.failed |= msgpack_pack_array(&f.pk, r->num_token_ids[i]) != 0;
        for (size_t j = 0; j < r->num_token_ids[i]; j++) f.failed |= msgpack_pack_int32(&f.pk, r->token_ids[i][j]) != 0;
    }
    if (r->dimensions != KVD_UNSET) put_int(&f, "dimensions", r->dimensions);
    if (r->cache_salt != NULL) put_str(&f, "cache_salt", r->cache_salt);
    return finish(&f, out);
}

int kvd_pack_abort(msgpack_sbuffer *out, uint64_t id, uint64_t target) {
    fields f;
    fields_init(&f);
    put_header(&f, id, "abort");
    put_uint(&f, "target", target);
    return finish(&f, out);
}

int kvd_pack_op(msgpack_sbuffer *out, uint64_t id, const char *op) {
    fields f;
    fields_init(&f);
    put_header(&f, id, op);
    return finish(&f, out);
}

static int str_is(const msgpack_object *o, const char *s) {
    size_t n = strlen(s);
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == n && memcmp(o->via.str.ptr, s, n) == 0;
}

static const msgpack_object *map_get(const msgpack_object *map, const char *name) {
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (str_is(&map->via.map.ptr[i].key, name)) return &map->via.map.ptr[i].val;
    return NULL;
}

kvd_status kvd_decode_reply(const void *data, size_t size, kvd_reply *reply, kvd_error *error) {
    memset(reply, 0, sizeof *reply);
    msgpack_unpacked_init(&reply->unpacked);
    size_t offset = 0;
    msgpack_unpack_return ret = msgpack_unpack_next(&reply->unpacked, data, size, &offset);
    if (ret == MSGPACK_UNPACK_NOMEM_ERROR)
        return kvd_fail(error, KVD_ERR_NO_MEMORY, "out of memory decoding a reply");
    if (ret != MSGPACK_UNPACK_SUCCESS || offset != size)
        return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon sent a reply that is not one msgpack value");
    reply->map = &reply->unpacked.data;
    if (reply->map->type != MSGPACK_OBJECT_MAP)
        return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon sent a reply that is not a map");
    const msgpack_object *type = map_get(reply->map, "type");
    if (type == NULL || type->type != MSGPACK_OBJECT_STR)
        return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon sent a reply without a type");
    reply->type = type->via.str.ptr;
    reply->type_len = type->via.str.size;
    const msgpack_object *id = map_get(reply->map, "id");
    if (id == NULL || id->type == MSGPACK_OBJECT_NIL) {
        reply->id_kind = KVD_ID_NIL;
    } else if (id->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        reply->id_kind = KVD_ID_INT;
        reply->id = id->via.u64;
    } else {
        reply->id_kind = KVD_ID_OTHER; /* not an id this library sends */
    }
    return KVD_OK;
}

void kvd_reply_destroy(kvd_reply *reply) { msgpack_unpacked_destroy(&reply->unpacked); }

int kvd_reply_is(const kvd_reply *reply, const char *type) {
    return reply->type_len == strlen(type) && memcmp(reply->type, type, reply->type_len) == 0;
}

const msgpack_object *kvd_reply_get(const kvd_reply *reply, const char *name) { return map_get(reply->map, name); }

const msgpack_object *kvd_map_get(const msgpack_object *map, const char *name) {
    return map != NULL && map->type == MSGPACK_OBJECT_MAP ? map_get(map, name) : NULL;
}

int kvd_object_number(const msgpack_object *o, double *value) {
    if (o == NULL) return -1;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: *value = o->via.f64; return 0;
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *value = (double)o->via.u64; return 0;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *value = (double)o->via.i64; return 0;
    default: return -1;
    }
}

kvd_status kvd_reply_str(const kvd_reply *reply, const char *name, const char **str, size_t *len,
                         kvd_error *error) {
    const msgpack_object *o = map_get(reply->map, name);
    if (o == NULL || o->type != MSGPACK_OBJECT_STR)
        return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon's '%.*s' reply has no string '%s'",
                        (int)reply->type_len, reply->type, name);
    *str = o->via.str.ptr;
    *len = o->via.str.size;
    return KVD_OK;
}

kvd_status kvd_reply_int(const kvd_reply *reply, const msgpack_object *map, const char *name, int64_t *value,
                         kvd_error *error) {
    const msgpack_object *o = map_get(map, name);
    if (o != NULL && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX) {
        *value = (int64_t)o->via.u64;
        return KVD_OK;
    }
    if (o != NULL && o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *value = o->via.i64;
        return KVD_OK;
    }
    return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon's '%.*s' reply has no integer '%s'", (int)reply->type_len,
                    reply->type, name);
}

static void copy_str(char *dst, size_t dst_size, const msgpack_object *o) {
    if (o == NULL || o->type != MSGPACK_OBJECT_STR) {
        dst[0] = '\0';
        return;
    }
    snprintf(dst, dst_size, "%.*s", (int)o->via.str.size, o->via.str.ptr);
}

kvd_status kvd_reply_error(const kvd_reply *reply, kvd_error *error) {
    const msgpack_object *code = map_get(reply->map, "code");
    if (code == NULL || code->type != MSGPACK_OBJECT_STR)
        return kvd_fail(error, KVD_ERR_PROTOCOL, "the daemon sent an error reply without a code");
    kvd_status status = kvd_status_from_code(code->via.str.ptr, code->via.str.size);
    if (error != NULL) {
        error->status = status;
        copy_str(error->code, sizeof error->code, code);
        copy_str(error->field, sizeof error->field, map_get(reply->map, "field"));
        copy_str(error->message, sizeof error->message, map_get(reply->map, "message"));
    }
    return status;
}
