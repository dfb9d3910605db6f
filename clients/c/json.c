/* json.c: JSON text to msgpack, for the request fields the protocol wants as maps (tools).
 *
 * A strict RFC 8259 parser: one value, surrounded by optional whitespace. Objects become maps with str keys,
 * arrays arrays, strings str (escapes decoded, \u surrogate pairs joined into UTF-8), integers that fit int64
 * or uint64 ints, other numbers doubles. A msgpack container header needs its element count, so each
 * container is scanned once to count its elements before they are packed. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MAX_DEPTH 64
#define MAX_NUMBER_CHARS 64

typedef struct parser {
    const char *text;
    size_t len;
    size_t pos;
    const char *problem; /* set at the first error */
    int out_of_memory;
} parser;

static int fail(parser *p, const char *problem) {
    if (p->problem == NULL) p->problem = problem;
    return -1;
}

static void skip_space(parser *p) {
    while (p->pos < p->len) {
        char ch = p->text[p->pos];
        if (ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r') break;
        p->pos++;
    }
}

static int peek(const parser *p) { return p->pos < p->len ? (unsigned char)p->text[p->pos] : -1; }

static int literal(parser *p, const char *word) {
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0) return fail(p, "an unexpected character");
    p->pos += n;
    return 0;
}

static int hex4(parser *p, unsigned *value) {
    if (p->len - p->pos < 4) return fail(p, "a truncated \\u escape");
    *value = 0;
    for (int i = 0; i < 4; i++) {
        char ch = p->text[p->pos++];
        unsigned digit;
        if (ch >= '0' && ch <= '9') digit = (unsigned)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') digit = (unsigned)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') digit = (unsigned)(ch - 'A' + 10);
        else return fail(p, "a \\u escape that is not four hex digits");
        *value = *value << 4 | digit;
    }
    return 0;
}

static size_t put_utf8(char *out, unsigned cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18);
    out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A string at p->pos (the opening quote), decoded and packed when pk is not NULL. The decoded text is never
 * longer than its JSON form (an escape of n chars gives at most n bytes), so one buffer of that size holds it. */
static int string(parser *p, msgpack_packer *pk) {
    p->pos++; /* the quote */
    size_t start = p->pos;
    char *buf = NULL;
    if (pk != NULL) {
        buf = malloc(p->len - start + 1); /* the rest of the text bounds the string */
        if (buf == NULL) {
            p->out_of_memory = 1;
            return fail(p, "out of memory");
        }
    }
    size_t n = 0;
    for (;;) {
        if (p->pos >= p->len) {
            free(buf);
            return fail(p, "an unterminated string");
        }
        unsigned char ch = (unsigned char)p->text[p->pos++];
        if (ch == '"') break;
        if (ch < 0x20) {
            free(buf);
            return fail(p, "a control character in a string (escape it)");
        }
        if (ch != '\\') {
            if (buf) buf[n] = (char)ch;
            n++;
            continue;
        }
        if (p->pos >= p->len) {
            free(buf);
            return fail(p, "an unterminated string");
        }
        char esc = p->text[p->pos++];
        char plain = 0;
        switch (esc) {
        case '"': plain = '"'; break;
        case '\\': plain = '\\'; break;
        case '/': plain = '/'; break;
        case 'b': plain = '\b'; break;
        case 'f': plain = '\f'; break;
        case 'n': plain = '\n'; break;
        case 'r': plain = '\r'; break;
        case 't': plain = '\t'; break;
        case 'u': {
            unsigned cp, low;
            if (hex4(p, &cp) != 0) {
                free(buf);
                return -1;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (p->len - p->pos < 2 || p->text[p->pos] != '\\' || p->text[p->pos + 1] != 'u') {
                    free(buf);
                    return fail(p, "a lone surrogate in a \\u escape");
                }
                p->pos += 2;
                if (hex4(p, &low) != 0 || low < 0xDC00 || low > 0xDFFF) {
                    free(buf);
                    return fail(p, "a lone surrogate in a \\u escape");
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                free(buf);
                return fail(p, "a lone surrogate in a \\u escape");
            }
            char utf8[4];
            size_t k = put_utf8(utf8, cp);
            if (buf) memcpy(buf + n, utf8, k);
            n += k;
            continue;
        }
        default: free(buf); return fail(p, "an invalid escape in a string");
        }
        if (buf) buf[n] = plain;
        n++;
    }
    int failed = 0;
    if (pk != NULL) {
        failed = msgpack_pack_str_with_body(pk, buf, n) != 0;
        free(buf);
        if (failed) {
            p->out_of_memory = 1;
            return fail(p, "out of memory");
        }
    }
    return 0;
}

static int digits(parser *p) {
    size_t start = p->pos;
    while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9') p->pos++;
    return p->pos > start ? 0 : fail(p, "a malformed number");
}

static int number(parser *p, msgpack_packer *pk) {
    size_t start = p->pos;
    int is_int = 1;
    if (peek(p) == '-') p->pos++;
    if (peek(p) == '0') p->pos++;
    else if (digits(p) != 0) return -1;
    if (peek(p) == '.') {
        is_int = 0;
        p->pos++;
        if (digits(p) != 0) return -1;
    }
    if (peek(p) == 'e' || peek(p) == 'E') {
        is_int = 0;
        p->pos++;
        if (peek(p) == '+' || peek(p) == '-') p->pos++;
        if (digits(p) != 0) return -1;
    }
    if (pk == NULL) return 0;
    size_t n = p->pos - start;
    if (n > MAX_NUMBER_CHARS) return fail(p, "a number of more than 64 characters");
    char text[MAX_NUMBER_CHARS + 1];
    memcpy(text, p->text + start, n);
    text[n] = '\0';
    int failed = -1;
    if (is_int) { /* an integer beyond 64 bits becomes a double */
        errno = 0;
        if (text[0] == '-') {
            long long v = strtoll(text, NULL, 10);
            if (errno == 0) failed = msgpack_pack_int64(pk, v) != 0;
        } else {
            unsigned long long v = strtoull(text, NULL, 10);
            if (errno == 0) failed = msgpack_pack_uint64(pk, v) != 0;
        }
    }
    if (failed == -1) failed = msgpack_pack_double(pk, strtod(text, NULL)) != 0;
    if (failed) {
        p->out_of_memory = 1;
        return fail(p, "out of memory");
    }
    return 0;
}

static int value(parser *p, msgpack_packer *pk, int depth);

/* The elements of the array or object at p->pos: counted (pk NULL), or packed after their header. */
static int container(parser *p, msgpack_packer *pk, int depth) {
    int object = peek(p) == '{';
    char close = object ? '}' : ']';
    if (depth >= MAX_DEPTH) return fail(p, "nesting deeper than 64 levels");
    size_t open = p->pos;
    uint32_t count = 0;
    /* Pass 1 counts (and validates); pass 2, only when packing, packs. */
    for (int pass = 0; pass < (pk != NULL ? 2 : 1); pass++) {
        msgpack_packer *out = pass == 0 ? NULL : pk;
        p->pos = open + 1;
        if (out != NULL) {
            int failed = object ? msgpack_pack_map(out, count) != 0 : msgpack_pack_array(out, count) != 0;
            if (failed) {
                p->out_of_memory = 1;
                return fail(p, "out of memory");
            }
        }
        skip_space(p);
        if (peek(p) == close) {
            p->pos++;
            continue;
        }
        for (uint32_t i = 0;; i++) {
            skip_space(p);
            if (object) {
                if (peek(p) != '"') return fail(p, "an object key that is not a string");
                if (string(p, out) != 0) return -1;
                skip_space(p);
                if (peek(p) != ':') return fail(p, "a missing ':' after an object key");
                p->pos++;
            }
            if (value(p, out, depth + 1) != 0) return -1;
            if (pass == 0) {
                if (count == UINT32_MAX) return fail(p, "too many elements");
                count++;
            }
            skip_space(p);
            if (peek(p) == ',') {
                p->pos++;
                continue;
            }
            if (peek(p) == close) {
                p->pos++;
                break;
            }
            return fail(p, object ? "a missing ',' or '}' in an object" : "a missing ',' or ']' in an array");
        }
    }
    return 0;
}

static int value(parser *p, msgpack_packer *pk, int depth) {
    skip_space(p);
    int failed = 0;
    switch (peek(p)) {
    case '{':
    case '[': return container(p, pk, depth);
    case '"': return string(p, pk);
    case 't':
        if (literal(p, "true") != 0) return -1;
        if (pk) failed = msgpack_pack_true(pk) != 0;
        break;
    case 'f':
        if (literal(p, "false") != 0) return -1;
        if (pk) failed = msgpack_pack_false(pk) != 0;
        break;
    case 'n':
        if (literal(p, "null") != 0) return -1;
        if (pk) failed = msgpack_pack_nil(pk) != 0;
        break;
    case -1: return fail(p, "the end of the text where a value was expected");
    default:
        if (peek(p) == '-' || (peek(p) >= '0' && peek(p) <= '9')) return number(p, pk);
        return fail(p, "an unexpected character");
    }
    if (failed) {
        p->out_of_memory = 1;
        return fail(p, "out of memory");
    }
    return 0;
}

kvd_status kvd_json_to_msgpack(const char *json, msgpack_sbuffer *out, const char *field, kvd_error *error) {
    parser p = {json, strlen(json), 0, NULL, 0};
    msgpack_packer pk;
    msgpack_packer_init(&pk, out, msgpack_sbuffer_write);
    if (value(&p, &pk, 0) == 0) {
        skip_space(&p);
        if (p.pos == p.len) return KVD_OK;
        fail(&p, "text after the value");
    }
    if (p.out_of_memory) return kvd_fail(error, KVD_ERR_NO_MEMORY, "out of memory converting %s to msgpack", field);
    kvd_status status = kvd_fail(error, KVD_ERR_INVALID_ARGUMENT, "%s is not valid JSON: %s at byte %zu", field,
                                 p.problem, p.pos);
    if (error != NULL) snprintf(error->field, sizeof error->field, "%s", field);
    return status;
}
