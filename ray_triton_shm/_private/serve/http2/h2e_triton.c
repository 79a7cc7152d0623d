/* The nghttp2 gRPC engine: the shared-memory requests a connection posts to Triton's HTTP
 * endpoint itself, and their answers. */
#include "_h2_engine.h"

static int exchange_connect(struct exchange *x);
static int exchange_send(struct exchange *x);
static size_t header_value(const unsigned char *head, size_t n, const char *name, char *out, size_t outn);

void h2e_exchange_close(struct exchange *x) {
    if (x->fd >= 0) close(x->fd);
    x->fd = -1;
    x->busy = 0;
    free(x->request);
    x->request = NULL;
    x->len = x->head_end = x->want = 0;
}

static int exchange_connect(struct exchange *x) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)x->port)};
    a.sin_addr.s_addr = x->addr;
    int one = 1;
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    x->fd = fd;
    x->reused = 0;
    return 0;
}

static int exchange_send(struct exchange *x) {
    size_t at = 0;
    while (at < x->request_len) {
        ssize_t w = send(x->fd, x->request + at, x->request_len - at, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        at += (size_t)w;
    }
    x->len = x->head_end = x->want = 0;
    x->code = 0;
    return 0;
}

/* Post a request for stream ``id``; -1: Triton cannot be reached (``why`` says so). */
int h2e_post(Connection *c, int32_t id, const char *host, int port, const char *data, size_t n, double timeout_s,
                const char **why) {
    uint32_t addr;
    if (inet_pton(AF_INET, host, &addr) != 1) {
        *why = "not an IPv4 address";
        return -1;
    }
    struct exchange *x = NULL;
    for (int i = 0; i < MAX_EXCHANGES && !x; i++)
        if (c->tx[i].fd >= 0 && !c->tx[i].busy && c->tx[i].addr == addr && c->tx[i].port == port) x = &c->tx[i];
    for (int i = 0; i < MAX_EXCHANGES && !x; i++)
        if (c->tx[i].fd < 0) x = &c->tx[i];
    if (!x) {
        *why = "too many requests at once";
        return -1;
    }
    int reuse = x->fd >= 0;
    x->addr = addr;
    x->port = port;
    x->request = malloc(n ? n : 1);
    if (!x->request) {
        *why = "out of memory";
        return -1;
    }
    memcpy(x->request, data, n);
    x->request_len = n;
    x->id = id;
    x->busy = 1;
    x->deadline = timeout_s > 0 ? h2e_now() + timeout_s : 0;
    if (!reuse && exchange_connect(x)) {
        *why = strerror(errno);
        h2e_exchange_close(x);
        return -1;
    }
    x->reused = reuse;
    if (exchange_send(x)) {
        /* a kept-alive socket Triton had closed: one fresh try */
        close(x->fd);
        x->fd = -1;
        if (exchange_connect(x) || exchange_send(x)) {
            *why = strerror(errno);
            h2e_exchange_close(x);
            return -1;
        }
    }
    return 0;
}

static size_t header_value(const unsigned char *head, size_t n, const char *name, char *out, size_t outn) {
    size_t nl = strlen(name);
    for (size_t i = 0; i + nl < n; i++) {
        if ((i == 0 || head[i - 1] == '\n') && !strncasecmp((const char *)head + i, name, nl) && head[i + nl] == ':') {
            size_t j = i + nl + 1, k = 0;
            while (j < n && head[j] == ' ') j++;
            while (j < n && head[j] != '\r' && k + 1 < outn) out[k++] = (char)head[j++];
            out[k] = 0;
            return k;
        }
    }
    return 0;
}

/* Bytes from Triton: a whole answer is handed to Python. */
int h2e_exchange_read(Connection *c, struct exchange *x) {
    if (x->cap - x->len < 65536) {
        size_t cap = x->cap ? x->cap * 2 : 65536;
        while (cap - x->len < 65536) cap *= 2;
        unsigned char *b = realloc(x->buf, cap);
        if (!b) return h2e_answer_posted(c, x, -2, (const unsigned char *)"out of memory", 13);
        x->buf = b;
        x->cap = cap;
    }
    ssize_t r = recv(x->fd, x->buf + x->len, x->cap - x->len, 0);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (r <= 0) {
        if (x->len == 0 && x->reused) { /* the idle socket was closed by Triton: post again */
            close(x->fd);
            x->fd = -1;
            if (!exchange_connect(x) && !exchange_send(x)) return 0;
        }
        const char *why = r == 0 ? "Triton closed the connection while answering" : strerror(errno);
        x->keep = 0;
        return h2e_answer_posted(c, x, -2, (const unsigned char *)why, strlen(why));
    }
    x->len += (size_t)r;
    if (!x->head_end) {
        unsigned char *end = memmem(x->buf, x->len, "\r\n\r\n", 4);
        if (!end) {
            if (x->len > 65536) {
                x->keep = 0;
                return h2e_answer_posted(c, x, -2, (const unsigned char *)"answer headers too long", 23);
            }
            return 0;
        }
        x->head_end = (size_t)(end - x->buf) + 4;
        char value[32];
        if (x->len < 12 || memcmp(x->buf, "HTTP/1.", 7) || !header_value(x->buf, x->head_end, "content-length", value, sizeof value)) {
            x->keep = 0;
            return h2e_answer_posted(c, x, -2, (const unsigned char *)"unreadable answer", 17);
        }
        x->code = atoi((const char *)x->buf + 9);
        x->want = x->head_end + strtoul(value, NULL, 10);
        x->keep = !(header_value(x->buf, x->head_end, "connection", value, sizeof value) && !strcasecmp(value, "close"));
    }
    if (x->len < x->want) return 0;
    return h2e_answer_posted(c, x, x->code, x->buf + x->head_end, x->want - x->head_end);
}

/* Python ends the call with Triton's answer; it may post the request once more. */
int h2e_answer_posted(Connection *c, struct exchange *x, int code, const unsigned char *body, size_t n) {
    int32_t id = x->id;
    int keep = code >= 0 && x->keep && x->len == x->want;
    x->busy = 0;
    free(x->request);
    x->request = NULL;
    if (!keep) h2e_exchange_close(x);
    x->len = x->head_end = x->want = 0;
    h2e_enter(c);
    PyObject *r = PyObject_CallMethod(c->handler, "answered", "(iiy#)", id, code, (const char *)body, (Py_ssize_t)n);
    int bad = 0;
    if (!r) {
        h2e_keep_error(c);
        bad = -1;
    } else if (r != Py_None) {
        const char *host, *data;
        Py_ssize_t dn;
        int port;
        double timeout_s;
        if (!PyArg_ParseTuple(r, "siy#d", &host, &port, &data, &dn, &timeout_s)) {
            h2e_keep_error(c);
            bad = -1;
        } else {
            const char *why = NULL;
            if (h2e_post_unlocked(c, id, host, port, data, (size_t)dn, timeout_s, &why)) {
                PyObject *r2 = PyObject_CallMethod(c->handler, "answered", "(iiy)", id, -2, why);
                if (!r2) h2e_keep_error(c);
                Py_XDECREF(r2);
            }
        }
    }
    Py_XDECREF(r);
    h2e_leave(c);
    return bad;
}

/* :func:`post` from a caller that holds the GIL, which other threads get meanwhile (``data`` and
 * ``host`` stay alive: the caller holds the object they belong to). */
int h2e_post_unlocked(Connection *c, int32_t id, const char *host, int port, const char *data, size_t n,
                         double timeout_s, const char **why) {
    PyThreadState *ts = PyEval_SaveThread();
    int r = h2e_post(c, id, host, port, data, n, timeout_s, why);
    PyEval_RestoreThread(ts);
    return r;
}

int h2e_busy_exchanges(Connection *c) {
    int n = 0;
    for (int i = 0; i < MAX_EXCHANGES; i++) n += c->tx[i].busy;
    return n;
}
