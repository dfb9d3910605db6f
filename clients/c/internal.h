/* internal.h: what the library's files share; not installed. */
#ifndef KVD_INTERNAL_H
#define KVD_INTERNAL_H

#include <msgpack.h>

#include "kvd.h"

/* Fill `error` (if not NULL) with a local failure; returns `status` for `return kvd_fail(...)`. */
kvd_status kvd_fail(kvd_error *error, kvd_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* 1 for a checked tcp endpoint to an IPv6 address (tcp://[::1]:PORT), else 0 (endpoint.c). */
int kvd_endpoint_is_ipv6(const char *url);

/* KVD_OK unless `dir`, the /tmp folder of the default endpoint, exists and is not a real directory (lstat: no
 * symbolic link) owned by this user and closed to others: KVD_ERR_ENDPOINT, the message saying what to do. A
 * missing folder passes (endpoint.c). */
kvd_status kvd_check_private_dir(const char *dir, kvd_error *error);

/* The status for a daemon error code string ("bad_request" -> KVD_ERR_BAD_REQUEST). */
kvd_status kvd_status_from_code(const char *code, size_t len);

/* JSON text to msgpack appended to `out` (json.c). A malformed text is KVD_ERR_INVALID_ARGUMENT with
 * error->field set to `field`. */
kvd_status kvd_json_to_msgpack(const char *json, msgpack_sbuffer *out, const char *field, kvd_error *error);

/* Encoding requests (wire.c). Each returns 0, or -1 when out of memory. `tools` is the msgpack of
 * request->tools_json (kvd_json_to_msgpack), or NULL. */
int kvd_pack_generate(msgpack_sbuffer *out, uint64_t id, const kvd_request *request, int stream,
                      const msgpack_sbuffer *tools);
int kvd_pack_embed(msgpack_sbuffer *out, uint64_t id, const kvd_embed_request *request);
int kvd_pack_abort(msgpack_sbuffer *out, uint64_t id, uint64_t target);
int kvd_pack_op(msgpack_sbuffer *out, uint64_t id, const char *op); /* an op without fields: health */

/* A decoded reply. `id_kind` tells whether `id` is this library's kind of id. */
typedef enum { KVD_ID_INT, KVD_ID_NIL, KVD_ID_OTHER } kvd_id_kind;

typedef struct kvd_reply {
    msgpack_unpacked unpacked; /* owns the decoded objects */
    const msgpack_object *map;
    kvd_id_kind id_kind;
    uint64_t id;
    const char *type;
    size_t type_len;
} kvd_reply;

kvd_status kvd_decode_reply(const void *data, size_t size, kvd_reply *reply, kvd_error *error);
void kvd_reply_destroy(kvd_reply *reply);
int kvd_reply_is(const kvd_reply *reply, const char *type);

/* Typed field access: KVD_OK, or KVD_ERR_PROTOCOL (missing or wrong type) with `error` filled. */
const msgpack_object *kvd_reply_get(const kvd_reply *reply, const char *key);
kvd_status kvd_reply_str(const kvd_reply *reply, const char *key, const char **str, size_t *len,
                         kvd_error *error);
kvd_status kvd_reply_int(const kvd_reply *reply, const msgpack_object *map, const char *key, int64_t *value,
                         kvd_error *error);
/* A field of a nested map, or NULL. */
const msgpack_object *kvd_map_get(const msgpack_object *map, const char *key);
/* An int or float object as a double; returns 0, or -1 for another type. */
int kvd_object_number(const msgpack_object *o, double *value);
/* Copy a daemon `error` reply into `error`; returns its status. */
kvd_status kvd_reply_error(const kvd_reply *reply, kvd_error *error);

#endif /* KVD_INTERNAL_H */
