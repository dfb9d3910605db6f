/* endpoint.c: the default endpoint and endpoint checks, as docs/protocol.md "Endpoints" says. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* sun_path holds 108 bytes including the terminating NUL. */
#define MAX_IPC_PATH_BYTES 107
/* How a user whose /tmp folder is unsafe still reaches a daemon. */
#define ELSEWHERE "or set XDG_RUNTIME_DIR or KVD_ENDPOINT to choose another endpoint"

static kvd_status check_ipc(const char *url, const char *path, kvd_error *error) {
    if (path[0] == '@')
        return kvd_fail(error, KVD_ERR_ENDPOINT,
                        "endpoint '%s': abstract sockets have no file permissions; use a filesystem path", url);
    if (path[0] != '/')
        return kvd_fail(error, KVD_ERR_ENDPOINT,
                        "endpoint '%s': the ipc path must be absolute (client and daemon cwd differ)", url);
    if (strlen(path) > MAX_IPC_PATH_BYTES)
        return kvd_fail(error, KVD_ERR_ENDPOINT,
                        "endpoint '%s': the socket path is longer than %d bytes, the limit of a unix socket "
                        "address; choose a shorter path",
                        url, MAX_IPC_PATH_BYTES);
    return KVD_OK;
}

static kvd_status check_tcp(const char *url, const char *rest, kvd_error *error) {
    const char *colon = strrchr(rest, ':');
    if (colon == NULL || colon == rest)
        return kvd_fail(error, KVD_ERR_ENDPOINT, "endpoint '%s': expected tcp://HOST:PORT", url);
    const char *port = colon + 1;
    long value = 0;
    for (const char *p = port; *p; p++) {
        if (*p < '0' || *p > '9' || value > 65535) {
            value = -1;
            break;
        }
        value = value * 10 + (*p - '0');
    }
    if (*port == '\0' || value < 1 || value > 65535)
        return kvd_fail(error, KVD_ERR_ENDPOINT, "endpoint '%s': the port must be a number in [1, 65535]", url);
    return KVD_OK;
}

static kvd_status check_endpoint(const char *url, kvd_error *error) {
    const char *sep = strstr(url, "://");
    if (sep == NULL)
        return kvd_fail(error, KVD_ERR_ENDPOINT,
                        "endpoint '%s' has no scheme: use ipc://ABSOLUTE_PATH or tcp://HOST:PORT", url);
    size_t scheme_len = (size_t)(sep - url);
    if (scheme_len == 3 && strncmp(url, "ipc", 3) == 0) return check_ipc(url, sep + 3, error);
    if (scheme_len == 3 && strncmp(url, "tcp", 3) == 0) return check_tcp(url, sep + 3, error);
    return kvd_fail(error, KVD_ERR_ENDPOINT, "endpoint '%s': unsupported transport '%.*s'; use ipc:// or tcp://",
                    url, (int)scheme_len, url);
}

int kvd_endpoint_is_ipv6(const char *url) {
    if (strncmp(url, "tcp://", 6) != 0) return 0;
    const char *host = url + 6;
    /* Only an IPv6 address ([::1] or ::1) holds a colon before the port's: names and IPv4 addresses do not. */
    return memchr(host, ':', (size_t)(strrchr(host, ':') - host)) != NULL;
}

kvd_status kvd_check_private_dir(const char *dir, kvd_error *error) {
    struct stat st;
    if (lstat(dir, &st) != 0) {
        /* Missing: the daemon creates it. */
        if (errno == ENOENT) return KVD_OK;
        return kvd_fail(error, KVD_ERR_ENDPOINT, "cannot check %s: %s; " ELSEWHERE, dir, strerror(errno));
    }
    if (S_ISLNK(st.st_mode))
        return kvd_fail(error, KVD_ERR_ENDPOINT,
                        "%s is a symbolic link, not a directory of yours; remove it, " ELSEWHERE, dir);
    if (!S_ISDIR(st.st_mode))
        return kvd_fail(error, KVD_ERR_ENDPOINT, "%s is not a directory; remove it, " ELSEWHERE, dir);
    if (st.st_uid != getuid())
        return kvd_fail(error, KVD_ERR_ENDPOINT, "%s belongs to another user (uid %u); remove it, " ELSEWHERE,
                        dir, (unsigned)st.st_uid);
    if (st.st_mode & 077)
        return kvd_fail(error, KVD_ERR_ENDPOINT,
                        "%s is open to other users (mode %04o); run `chmod 700 %s`, " ELSEWHERE, dir,
                        (unsigned)(st.st_mode & 07777), dir);
    return KVD_OK;
}

/* The per-user default: ipc://$XDG_RUNTIME_DIR/kvd.sock, else ipc:///tmp/kvd-$UID/kvd.sock. */
static kvd_status default_endpoint(char *url, size_t url_size, kvd_error *error) {
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    int n;
    if (runtime != NULL && runtime[0] != '\0') {
        size_t len = strlen(runtime);
        while (len > 0 && runtime[len - 1] == '/') len--; /* "/run/user/1000/" is that directory */
        n = snprintf(url, url_size, "ipc://%.*s/kvd.sock", (int)len, runtime);
    } else {
        /* Literally /tmp, not $TMPDIR: a client and the daemon must agree even when their environments
         * differ. Anyone may create that folder first, so it must be ours, as the daemon demands too. */
        char dir[32];
        snprintf(dir, sizeof dir, "/tmp/kvd-%u", (unsigned)getuid());
        kvd_status status = kvd_check_private_dir(dir, error);
        if (status != KVD_OK) return status;
        n = snprintf(url, url_size, "ipc://%s/kvd.sock", dir);
    }
    if (n < 0 || (size_t)n >= url_size)
        return kvd_fail(error, KVD_ERR_ENDPOINT, "$XDG_RUNTIME_DIR is too long for a socket path");
    return KVD_OK;
}

kvd_status kvd_resolve_endpoint(const char *endpoint, char *url, size_t url_size, kvd_error *error) {
    if (url == NULL || url_size == 0)
        return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_resolve_endpoint: url must hold the result");
    char fallback[4096 + 32];
    const char *chosen = endpoint;
    if (chosen == NULL || chosen[0] == '\0') chosen = getenv("KVD_ENDPOINT");
    if (chosen == NULL || chosen[0] == '\0') {
        kvd_status status = default_endpoint(fallback, sizeof fallback, error);
        if (status != KVD_OK) return status;
        chosen = fallback;
    }
    kvd_status status = check_endpoint(chosen, error);
    if (status != KVD_OK) return status;
    if (strlen(chosen) >= url_size)
        return kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "kvd_resolve_endpoint: url holds %zu bytes, %zu needed",
                        url_size, strlen(chosen) + 1);
    strcpy(url, chosen);
    return KVD_OK;
}
