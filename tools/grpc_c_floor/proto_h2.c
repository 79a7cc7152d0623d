/* A measurement prototype, not a server to ship (see measure.py here): gRPC ModelInfer over
 * HTTP/2, one C thread per connection doing the whole call (frames, the request tensor read
 * straight into a shared-memory slot, the shared-memory request to Triton over HTTP, the answer
 * written from the slot). It decodes no headers (every stream is taken as ModelInfer), keeps
 * no limits and takes one input tensor: it measures the CPU floor of the front door's per-call
 * work.
 *
 * usage: proto_h2 PORT TRITON_HTTP_PORT SHM_KEY REGION_PREFIX SLOTS SLOT_BYTES
 * Slot k's input is the shm object SHM_KEY_in_k and its output SHM_KEY_out_k, each of
 * SLOT_BYTES, registered with Triton beforehand as regions REGION_PREFIX_in_k and
 * REGION_PREFIX_out_k.
 */
#define _GNU_SOURCE
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

#define MAX_STREAMS 64
#define HEAD_MAX 4096
#define BUF_SIZE 65536

static unsigned char *shm_base;
static size_t slot_bytes;
static int nslots;
static int triton_port;
static const char *prefix;
static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static int *slot_busy;

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

struct stream {
    uint32_t id;
    int used, slot, ended, in_head;
    int64_t send_window;
    unsigned char head[HEAD_MAX];
    size_t head_len, raw_start, raw_len, raw_got;
    char model[128], name[64], dtype[16];
    int64_t shape[8];
    int ndim;
};

struct conn {
    int fd, triton;
    unsigned char buf[BUF_SIZE];
    size_t start, end;
    int64_t send_window, peer_initial;
    uint32_t peer_max_frame;
    int64_t recv_window;
    struct stream streams[MAX_STREAMS];
    uint32_t ready[MAX_STREAMS];
    int nready;
};

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int fill(struct conn *c, size_t want) {
    if (c->start) {
        memmove(c->buf, c->buf + c->start, c->end - c->start);
        c->end -= c->start;
        c->start = 0;
    }
    while (c->end < want) {
        ssize_t n = recv(c->fd, c->buf + c->end, BUF_SIZE - c->end, 0);
        if (n <= 0) return -1;
        c->end += (size_t)n;
    }
    return 0;
}

static int take(struct conn *c, unsigned char *dst, size_t n) {
    size_t have = c->end - c->start;
    size_t k = have < n ? have : n;
    if (dst) memcpy(dst, c->buf + c->start, k);
    c->start += k;
    n -= k;
    if (dst) dst += k;
    while (n) {
        if (dst) {
            ssize_t r = recv(c->fd, dst, n, MSG_WAITALL);
            if (r <= 0) return -1;
            dst += r;
            n -= (size_t)r;
        } else {
            if (fill(c, n < BUF_SIZE ? n : BUF_SIZE)) return -1;
            size_t m = c->end - c->start < n ? c->end - c->start : n;
            c->start += m;
            n -= m;
        }
    }
    return 0;
}

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

static void frame_head(unsigned char *h, uint32_t len, int type, int flags, uint32_t sid) {
    h[0] = len >> 16; h[1] = len >> 8; h[2] = len;
    h[3] = type; h[4] = flags;
    h[5] = sid >> 24; h[6] = sid >> 16; h[7] = sid >> 8; h[8] = sid;
}

static int send_frame(struct conn *c, int type, int flags, uint32_t sid, const void *p, uint32_t len) {
    unsigned char h[9];
    frame_head(h, len, type, flags, sid);
    struct iovec iov[2] = {{h, 9}, {(void *)p, len}};
    return send_all(c->fd, iov, len ? 2 : 1);
}

static struct stream *find(struct conn *c, uint32_t id) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (c->streams[i].used && c->streams[i].id == id) return &c->streams[i];
    return NULL;
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

static void parse_input(struct stream *s, const unsigned char *p, size_t n) {
    size_t at = 0;
    while (at < n) {
        uint64_t tag, len;
        if (varint(p, n, &at, &tag)) return;
        int field = (int)(tag >> 3), wt = (int)(tag & 7);
        if (wt == 0) { uint64_t v; varint(p, n, &at, &v); if (field == 3 && s->ndim < 8) s->shape[s->ndim++] = (int64_t)v; continue; }
        if (wt != 2 || varint(p, n, &at, &len) || at + len > n) return;
        if (field == 1 && len < sizeof s->name) { memcpy(s->name, p + at, len); s->name[len] = 0; }
        if (field == 2 && len < sizeof s->dtype) { memcpy(s->dtype, p + at, len); s->dtype[len] = 0; }
        if (field == 3) { size_t e = at + len, q = at; uint64_t v; while (q < e && s->ndim < 8 && !varint(p, e, &q, &v)) s->shape[s->ndim++] = (int64_t)v; }
        at += len;
    }
}

/* Parse the message head (after the 5-byte prefix): 1 when the raw contents start is found. */
static int parse_head(struct stream *s) {
    if (s->head_len < 5) return 0;
    const unsigned char *p = s->head + 5;
    size_t n = s->head_len - 5, at = 0;
    s->ndim = 0;
    while (at < n) {
        uint64_t tag, len;
        if (varint(p, n, &at, &tag)) return 0;
        int field = (int)(tag >> 3), wt = (int)(tag & 7);
        if (wt == 0) { uint64_t v; if (varint(p, n, &at, &v)) return 0; continue; }
        if (wt != 2 || varint(p, n, &at, &len)) return 0;
        if (field == 7) { s->raw_start = 5 + at; s->raw_len = len; return 1; }
        if (at + len > n) return 0;
        if (field == 1 && len < sizeof s->model) { memcpy(s->model, p + at, len); s->model[len] = 0; }
        if (field == 5) parse_input(s, p + at, len);
        at += len;
    }
    return 0;
}

static int on_data(struct conn *c, struct stream *s, size_t len) {
    while (len) {
        if (s->in_head) {
            size_t room = HEAD_MAX - s->head_len, k = len < room ? len : room;
            if (!k) return -1;
            if (take(c, s->head + s->head_len, k)) return -1;
            s->head_len += k;
            len -= k;
            if (parse_head(s)) {
                s->in_head = 0;
                size_t extra = s->head_len - s->raw_start;
                if (extra > s->raw_len || s->raw_len > slot_bytes) return -1;
                memcpy(shm_base + (size_t)(2 * s->slot) * slot_bytes, s->head + s->raw_start, extra);
                s->raw_got = extra;
            }
        } else {
            size_t want = s->raw_len - s->raw_got;
            if (len > want) return -1; /* only one raw input in this prototype */
            if (take(c, shm_base + (size_t)(2 * s->slot) * slot_bytes + s->raw_got, len)) return -1;
            s->raw_got += len;
            len = 0;
        }
    }
    return 0;
}

static int frame(struct conn *c) {
    if (c->end - c->start < 9 && fill(c, 9)) return -1;
    unsigned char *h = c->buf + c->start;
    uint32_t len = (uint32_t)h[0] << 16 | (uint32_t)h[1] << 8 | h[2];
    int type = h[3], flags = h[4];
    uint32_t sid = ((uint32_t)h[5] << 24 | (uint32_t)h[6] << 16 | (uint32_t)h[7] << 8 | h[8]) & 0x7fffffff;
    c->start += 9;
    unsigned char small[64];
    switch (type) {
    case 0: { /* DATA */
        struct stream *s = find(c, sid);
        if (!s || (flags & 0x8)) return -1;
        if (on_data(c, s, len)) return -1;
        c->recv_window -= len;
        if (c->recv_window < (1L << 30)) {
            uint32_t inc = htonl((uint32_t)(0x7fffffff - c->recv_window));
            if (send_frame(c, 8, 0, 0, &inc, 4)) return -1;
            c->recv_window = 0x7fffffff;
        }
        if (flags & 1) { s->ended = 1; c->ready[c->nready++] = sid; }
        return 0;
    }
    case 1: { /* HEADERS: the block is not decoded */
        if (!(flags & 0x4)) return -1;
        if (take(c, NULL, len)) return -1;
        struct stream *s = NULL;
        for (int i = 0; i < MAX_STREAMS; i++) if (!c->streams[i].used) { s = &c->streams[i]; break; }
        if (!s) return -1;
        memset(s, 0, offsetof(struct stream, head));
        s->used = 1; s->id = sid; s->in_head = 1; s->head_len = 0; s->send_window = c->peer_initial;
        s->slot = lease_slot();
        if (s->slot < 0) return -1;
        return 0;
    }
    case 3: { /* RST_STREAM */
        if (take(c, small, 4)) return -1;
        struct stream *s = find(c, sid);
        if (s && !s->ended) { release_slot(s->slot); s->used = 0; }
        return 0;
    }
    case 4: { /* SETTINGS */
        if (flags & 1) return take(c, NULL, len);
        unsigned char p[256];
        if (len > sizeof p || take(c, p, len)) return -1;
        for (uint32_t i = 0; i + 6 <= len; i += 6) {
            int id = p[i] << 8 | p[i + 1];
            uint32_t v = (uint32_t)p[i + 2] << 24 | (uint32_t)p[i + 3] << 16 | (uint32_t)p[i + 4] << 8 | p[i + 5];
            if (id == 4) {
                int64_t delta = (int64_t)v - c->peer_initial;
                c->peer_initial = v;
                for (int k = 0; k < MAX_STREAMS; k++) if (c->streams[k].used) c->streams[k].send_window += delta;
            }
            if (id == 5) c->peer_max_frame = v;
        }
        return send_frame(c, 4, 1, 0, NULL, 0);
    }
    case 6: /* PING */
        if (take(c, small, 8)) return -1;
        return (flags & 1) ? 0 : send_frame(c, 6, 1, 0, small, 8);
    case 7: return -1; /* GOAWAY */
    case 8: { /* WINDOW_UPDATE */
        if (take(c, small, 4)) return -1;
        uint32_t inc = ((uint32_t)small[0] << 24 | (uint32_t)small[1] << 16 | (uint32_t)small[2] << 8 | small[3]) & 0x7fffffff;
        if (!sid) c->send_window += inc;
        else { struct stream *s = find(c, sid); if (s) s->send_window += inc; }
        return 0;
    }
    default: return take(c, NULL, len);
    }
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

static int triton_connect(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(triton_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect triton");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* The shared-memory request to Triton; 0 on a 200. */
static int triton_call(struct conn *c, struct stream *s, size_t nbytes) {
    char body[1024], shape[256], req[1536];
    size_t sl = 0;
    for (int i = 0; i < s->ndim; i++) sl += (size_t)snprintf(shape + sl, sizeof shape - sl, "%s%lld", i ? "," : "", (long long)s->shape[i]);
    int bl = snprintf(body, sizeof body,
        "{\"inputs\":[{\"name\":\"%s\",\"shape\":[%s],\"datatype\":\"%s\",\"parameters\":{\"shared_memory_region\":\"%s_in_%d\",\"shared_memory_byte_size\":%zu}}],"
        "\"outputs\":[{\"name\":\"OUTPUT0\",\"parameters\":{\"shared_memory_region\":\"%s_out_%d\",\"shared_memory_byte_size\":%zu}}]}",
        s->name, shape, s->dtype, prefix, s->slot, nbytes, prefix, s->slot, slot_bytes);
    int rl = snprintf(req, sizeof req, "POST /v2/models/%s/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", s->model, bl, body);
    if (send(c->triton, req, (size_t)rl, 0) != rl) return -1;
    char ans[8192];
    size_t got = 0;
    char *end = NULL;
    while (!end) {
        ssize_t n = recv(c->triton, ans + got, sizeof ans - 1 - got, 0);
        if (n <= 0) return -1;
        got += (size_t)n;
        ans[got] = 0;
        end = strstr(ans, "\r\n\r\n");
    }
    char *cl = strcasestr(ans, "content-length:");
    size_t length = cl ? strtoul(cl + 15, NULL, 10) : 0;
    size_t have = got - (size_t)(end + 4 - ans);
    while (have < length) {
        ssize_t n = recv(c->triton, ans, sizeof ans, 0);
        if (n <= 0) return -1;
        have += (size_t)n;
    }
    return strncmp(ans, "HTTP/1.1 200", 12) ? -1 : 0;
}

static const unsigned char RESPONSE_BLOCK[] = {
    0x88, 0x0f, 0x10, 16, 'a', 'p', 'p', 'l', 'i', 'c', 'a', 't', 'i', 'o', 'n', '/', 'g', 'r', 'p', 'c'};
static const unsigned char OK_BLOCK[] = {0x00, 11, 'g', 'r', 'p', 'c', '-', 's', 't', 'a', 't', 'u', 's', 1, '0'};

static int answer(struct conn *c, struct stream *s) {
    size_t nbytes = s->raw_len;
    int failed = triton_call(c, s, nbytes);
    if (send_frame(c, 1, 0x4, s->id, RESPONSE_BLOCK, sizeof RESPONSE_BLOCK)) return -1;
    if (failed) {
        static const unsigned char ERR[] = {0x00, 11, 'g', 'r', 'p', 'c', '-', 's', 't', 'a', 't', 'u', 's', 2, '1', '3'};
        return send_frame(c, 1, 0x5, s->id, ERR, sizeof ERR);
    }
    unsigned char out[512], pb[1024];
    size_t on = put_bytes(out, 1, "OUTPUT0", 7);
    on += put_bytes(out + on, 2, s->dtype, strlen(s->dtype));
    unsigned char packed[96];
    size_t pn = 0;
    for (int i = 0; i < s->ndim; i++) pn += put_varint(packed + pn, (uint64_t)s->shape[i]);
    on += put_bytes(out + on, 3, packed, pn);
    size_t n = 5;
    n += put_bytes(pb + n, 1, s->model, strlen(s->model));
    n += put_bytes(pb + n, 2, "1", 1);
    n += put_bytes(pb + n, 5, out, on);
    n += put_varint(pb + n, 6 << 3 | 2);
    n += put_varint(pb + n, nbytes);
    size_t total = n - 5 + nbytes;
    pb[0] = 0; pb[1] = total >> 24; pb[2] = total >> 16; pb[3] = total >> 8; pb[4] = total;
    const unsigned char *data = shm_base + (size_t)(2 * s->slot + 1) * slot_bytes;
    size_t sent = 0, all = n + nbytes; /* bytes of pb then data */
    struct iovec iov[200];
    unsigned char heads[64][9];
    while (sent < all) {
        int64_t room = c->send_window < s->send_window ? c->send_window : s->send_window;
        if (room <= 0) { if (frame(c)) return -1; continue; }
        int k = 0, f = 0;
        while (sent < all && room > 0 && f < 64) {
            size_t flen = all - sent;
            if (flen > c->peer_max_frame) flen = c->peer_max_frame;
            if ((int64_t)flen > room) flen = (size_t)room;
            frame_head(heads[f], (uint32_t)flen, 0, 0, s->id);
            iov[k++] = (struct iovec){heads[f++], 9};
            size_t at = sent, left = flen;
            if (at < n) { size_t m = n - at < left ? n - at : left; iov[k++] = (struct iovec){pb + at, m}; at += m; left -= m; }
            if (left) iov[k++] = (struct iovec){(void *)(data + (at - n)), left};
            sent += flen; room -= (int64_t)flen;
            c->send_window -= (int64_t)flen; s->send_window -= (int64_t)flen;
        }
        if (send_all(c->fd, iov, k)) return -1;
    }
    return send_frame(c, 1, 0x5, s->id, OK_BLOCK, sizeof OK_BLOCK);
}

static void *serve(void *arg) {
    struct conn *c = arg;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->send_window = 65535; c->peer_initial = 65535; c->peer_max_frame = 16384; c->recv_window = 0x7fffffff;
    c->triton = triton_connect();
    if (fill(c, 24) || memcmp(c->buf, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 24)) goto out;
    c->start = 24;
    unsigned char settings[] = {0, 3, 0, 0, 0, 64, 0, 4, 0x7f, 0xff, 0xff, 0xff, 0, 5, 0x00, 0xff, 0xff, 0xff};
    uint32_t inc = htonl(0x7fffffff - 65535);
    if (send_frame(c, 4, 0, 0, settings, sizeof settings) || send_frame(c, 8, 0, 0, &inc, 4)) goto out;
    for (;;) {
        if (frame(c)) break;
        while (c->nready) {
            uint32_t sid = c->ready[0];
            memmove(c->ready, c->ready + 1, sizeof(uint32_t) * (size_t)--c->nready);
            struct stream *s = find(c, sid);
            if (!s) continue;
            int bad = answer(c, s);
            release_slot(s->slot);
            s->used = 0;
            if (bad) goto out;
        }
    }
out:
    for (int i = 0; i < MAX_STREAMS; i++) if (c->streams[i].used) release_slot(c->streams[i].slot);
    close(c->triton);
    close(c->fd);
    free(c);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: proto_h2 PORT TRITON_HTTP_PORT SHM_NAME PREFIX SLOTS SLOT_BYTES\n"); return 2; }
    int port = atoi(argv[1]);
    triton_port = atoi(argv[2]);
    prefix = argv[4];
    nslots = atoi(argv[5]);
    slot_bytes = strtoull(argv[6], NULL, 10);
    slot_busy = calloc((size_t)nslots, sizeof(int));
    /* one shm object per region, "<SHM_NAME>_in_k" and "<SHM_NAME>_out_k", mapped side by side */
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
    fprintf(stderr, "proto_h2 listening on %d\n", port);
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) continue;
        struct conn *c = calloc(1, sizeof *c);
        c->fd = fd;
        pthread_t t;
        pthread_create(&t, NULL, serve, c);
        pthread_detach(t);
    }
}
