/* What the two measurement prototypes (proto_h2.c, proto_nghttp2.c) share: the slots, the
 * ModelInfer request's head (read just far enough to find its one raw input), the request to
 * Triton, the answer's message head, and the listening loop. Included by each, once.
 */
#ifndef PROTO_COMMON_H
#define PROTO_COMMON_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define HEAD_MAX 4096

static unsigned char *shm_base;
static size_t slot_bytes;
static int nslots;
static int triton_port;
static const char *prefix;
static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static int *slot_busy;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int lease_slot(void) {
    pthread_mutex_lock(&slot_mu);
    for (int k = 0; k < nslots; k++)
        if (!slot_busy[k]) {
            slot_busy[k] = 1;
            pthread_mutex_unlock(&slot_mu);
            return k;
        }
    pthread_mutex_unlock(&slot_mu);
    return -1;
}

static void release_slot(int k) {
    pthread_mutex_lock(&slot_mu);
    slot_busy[k] = 0;
    pthread_mutex_unlock(&slot_mu);
}

/* One call's request: its message head, where its raw input starts, and what it describes. */
struct request {
    int slot;
    unsigned char head[HEAD_MAX];
    size_t head_len, raw_start, raw_len, raw_got;
    char model[128], name[64], dtype[16];
    int64_t shape[8];
    int ndim;
};

static unsigned char *input_of(const struct request *r) { return shm_base + (size_t)(2 * r->slot) * slot_bytes; }
static unsigned char *output_of(const struct request *r) { return shm_base + (size_t)(2 * r->slot + 1) * slot_bytes; }

static int send_all(int fd, struct iovec *iov, int n) {
    while (n) {
        ssize_t w = writev(fd, iov, n > 1024 ? 1024 : n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        while (n && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

static int varint(const unsigned char *p, size_t n, size_t *at, uint64_t *v) {
    uint64_t r = 0;
    for (int s = 0; s < 64 && *at < n; s += 7) {
        unsigned char b = p[(*at)++];
        r |= (uint64_t)(b & 0x7f) << s;
        if (!(b & 0x80)) { *v = r; return 0; }
    }
    return -1;
}

static void parse_input(struct request *r, const unsigned char *p, size_t n) {
    size_t at = 0;
    while (at < n) {
        uint64_t tag, len;
        if (varint(p, n, &at, &tag)) return;
        int field = (int)(tag >> 3), wt = (int)(tag & 7);
        if (wt == 0) { uint64_t v = 0; if (varint(p, n, &at, &v)) return; if (field == 3 && r->ndim < 8) r->shape[r->ndim++] = (int64_t)v; continue; }
        if (wt != 2 || varint(p, n, &at, &len) || at + len > n) return;
        if (field == 1 && len < sizeof r->name) { memcpy(r->name, p + at, len); r->name[len] = 0; }
        if (field == 2 && len < sizeof r->dtype) { memcpy(r->dtype, p + at, len); r->dtype[len] = 0; }
        if (field == 3) { size_t e = at + len, q = at; uint64_t v; while (q < e && r->ndim < 8 && !varint(p, e, &q, &v)) r->shape[r->ndim++] = (int64_t)v; }
        at += len;
    }
}

/* Parse the message head (after the 5-byte prefix): 1 when the raw contents' start is found. */
static int parse_head(struct request *r) {
    if (r->head_len < 5) return 0;
    const unsigned char *p = r->head + 5;
    size_t n = r->head_len - 5, at = 0;
    r->ndim = 0;
    while (at < n) {
        uint64_t tag, len;
        if (varint(p, n, &at, &tag)) return 0;
        int field = (int)(tag >> 3), wt = (int)(tag & 7);
        if (wt == 0) { uint64_t v; if (varint(p, n, &at, &v)) return 0; continue; }
        if (wt != 2 || varint(p, n, &at, &len)) return 0;
        if (field == 7) { r->raw_start = 5 + at; r->raw_len = len; return 1; }
        if (at + len > n) return 0;
        if (field == 1 && len < sizeof r->model) { memcpy(r->model, p + at, len); r->model[len] = 0; }
        if (field == 5) parse_input(r, p + at, len);
        at += len;
    }
    return 0;
}

static size_t put_varint(unsigned char *p, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) { p[n++] = (unsigned char)(v | 0x80); v >>= 7; }
    p[n++] = (unsigned char)v;
    return n;
}

static size_t put_bytes(unsigned char *p, int field, const void *b, size_t len) {
    size_t n = put_varint(p, (uint64_t)field << 3 | 2);
    n += put_varint(p + n, len);
    memcpy(p + n, b, len);
    return n + len;
}

/* The answer's gRPC prefix and ModelInferResponse fields up to its raw output's length, in pb
 * (1 KiB); returns their length. The raw output (raw_len bytes of the slot) follows. */
static size_t answer_head(const struct request *r, unsigned char *pb) {
    unsigned char out[512], packed[96];
    size_t on = put_bytes(out, 1, "OUTPUT0", 7);
    on += put_bytes(out + on, 2, r->dtype, strlen(r->dtype));
    size_t pn = 0;
    for (int i = 0; i < r->ndim; i++) pn += put_varint(packed + pn, (uint64_t)r->shape[i]);
    on += put_bytes(out + on, 3, packed, pn);
    size_t n = 5;
    n += put_bytes(pb + n, 1, r->model, strlen(r->model));
    n += put_bytes(pb + n, 2, "1", 1);
    n += put_bytes(pb + n, 5, out, on);
    n += put_varint(pb + n, 6 << 3 | 2);
    n += put_varint(pb + n, r->raw_len);
    size_t message = n - 5 + r->raw_len;
    pb[0] = 0; pb[1] = message >> 24; pb[2] = message >> 16; pb[3] = message >> 8; pb[4] = message;
    return n;
}

static int triton_connect(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(triton_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect triton");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* The shared-memory request to Triton on ``fd``; 0 on a 200. */
static int triton_call(int fd, const struct request *r) {
    char body[1024], shape[256], req[1536];
    size_t sl = 0;
    for (int i = 0; i < r->ndim; i++) sl += (size_t)snprintf(shape + sl, sizeof shape - sl, "%s%lld", i ? "," : "", (long long)r->shape[i]);
    int bl = snprintf(body, sizeof body,
        "{\"inputs\":[{\"name\":\"%s\",\"shape\":[%s],\"datatype\":\"%s\",\"parameters\":{\"shared_memory_region\":\"%s_in_%d\",\"shared_memory_byte_size\":%zu}}],"
        "\"outputs\":[{\"name\":\"OUTPUT0\",\"parameters\":{\"shared_memory_region\":\"%s_out_%d\",\"shared_memory_byte_size\":%zu}}]}",
        r->name, shape, r->dtype, prefix, r->slot, r->raw_len, prefix, r->slot, slot_bytes);
    int rl = snprintf(req, sizeof req, "POST /v2/models/%s/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", r->model, bl, body);
    if (send(fd, req, (size_t)rl, 0) != rl) return -1;
    char ans[8192];
    size_t got = 0;
    char *end = NULL;
    while (!end) {
        ssize_t n = recv(fd, ans + got, sizeof ans - 1 - got, 0);
        if (n <= 0) return -1;
        got += (size_t)n;
        ans[got] = 0;
        end = strstr(ans, "\r\n\r\n");
    }
    char *cl = strcasestr(ans, "content-length:");
    size_t length = cl ? strtoul(cl + 15, NULL, 10) : 0;
    size_t have = got - (size_t)(end + 4 - ans);
    while (have < length) {
        ssize_t n = recv(fd, ans, sizeof ans, 0);
        if (n <= 0) return -1;
        have += (size_t)n;
    }
    return strncmp(ans, "HTTP/1.1 200", 12) ? -1 : 0;
}

/* PORT TRITON_HTTP_PORT SHM_KEY REGION_PREFIX SLOTS SLOT_BYTES: the slots mapped (slot k's input
 * is the shm object SHM_KEY_in_k, its output SHM_KEY_out_k, side by side), then each accepted
 * connection served by ``serve`` in a thread of its own, given a zeroed ``conn_size`` bytes
 * whose first int is the connection's fd. Never returns. */
static void serve_forever(char **argv, const char *name, void *(*serve)(void *), size_t conn_size) {
    int port = atoi(argv[1]);
    triton_port = atoi(argv[2]);
    prefix = argv[4];
    nslots = atoi(argv[5]);
    slot_bytes = strtoull(argv[6], NULL, 10);
    slot_busy = calloc((size_t)nslots, sizeof(int));
    shm_base = mmap(NULL, 2 * (size_t)nslots * slot_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (shm_base == MAP_FAILED) die("mmap");
    for (int k = 0; k < 2 * nslots; k++) {
        char nm[256];
        snprintf(nm, sizeof nm, "%s_%s_%d", argv[3], k % 2 ? "out" : "in", k / 2);
        int shm = shm_open(nm, O_RDWR, 0);
        if (shm < 0) die("shm_open");
        if (mmap(shm_base + (size_t)k * slot_bytes, slot_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, shm, 0) == MAP_FAILED) die("mmap region");
        close(shm);
    }
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 64)) die("listen");
    fprintf(stderr, "%s listening on %d\n", name, port);
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) continue;
        int *c = calloc(1, conn_size);
        *c = fd;
        pthread_t t;
        pthread_create(&t, NULL, serve, c);
        pthread_detach(t);
    }
}

#endif
