/* error.c: status names and error filling. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const struct {
    kvd_status status;
    const char *name;
} NAMES[] = {
    {KVD_OK, "ok"},
    {KVD_ERR_BAD_REQUEST, "bad_request"},
    {KVD_ERR_UNSUPPORTED_VERSION, "unsupported_version"},
    {KVD_ERR_TOO_LARGE, "too_large"},
    {KVD_ERR_OVERLOADED, "overloaded"},
    {KVD_ERR_NOT_FOUND, "not_found"},
    {KVD_ERR_SHUTTING_DOWN, "shutting_down"},
    {KVD_ERR_INTERNAL, "internal"},
    {KVD_ERR_DAEMON_OTHER, "daemon_other"},
    {KVD_ERR_CLIENT_TIMEOUT, "client_timeout"},
    {KVD_ERR_NO_DAEMON, "no_daemon"},
    {KVD_ERR_TIMEOUT, "timeout"},
    {KVD_ERR_PROTOCOL, "protocol"},
    {KVD_ERR_ENDPOINT, "endpoint"},
    {KVD_ERR_INVALID_ARGUMENT, "invalid_argument"},
    {KVD_ERR_NO_MEMORY, "no_memory"},
    {KVD_ERR_ZMQ, "zmq"},
};

const char *kvd_status_name(kvd_status status) {
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (NAMES[i].status == status) return NAMES[i].name;
    return "unknown";
}

kvd_status kvd_status_from_code(const char *code, size_t len) {
    /* Only the daemon's codes: a local name sent by a daemon would be a protocol violation. */
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++) {
        kvd_status s = NAMES[i].status;
        int daemon_code = (s >= KVD_ERR_BAD_REQUEST && s <= KVD_ERR_INTERNAL) || s == KVD_ERR_CLIENT_TIMEOUT;
        if (daemon_code && strlen(NAMES[i].name) == len &&
            memcmp(NAMES[i].name, code, len) == 0)
            return s;
    }
    return KVD_ERR_DAEMON_OTHER;
}

kvd_status kvd_fail(kvd_error *error, kvd_status status, const char *fmt, ...) {
    if (error == NULL) return status;
    error->status = status;
    snprintf(error->code, sizeof error->code, "%s", kvd_status_name(status));
    error->field[0] = '\0';
    va_list args;
    va_start(args, fmt);
    vsnprintf(error->message, sizeof error->message, fmt, args);
    va_end(args);
    return status;
}
