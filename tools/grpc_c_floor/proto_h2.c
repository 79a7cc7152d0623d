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
#include "proto_common.h"

#define MAX_STREAMS 64
#define BUF_SIZE 65536

struct stream {
    uint32_t id;
    int used, ended, in_head;
    int64_t send_window;
    struct request r;
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

static int on_data(struct conn *c, struct stream *s, size_t len) {
    while (len) {
        if (s->in_head) {
            size_t room = HEAD_MAX - s->r.head_len, k = len < room ? len : room;
            if (!k) return -1;
            if (take(c, s->r.head + s->r.head_len, k)) return -1;
            s->r.head_len += k;
            len -= k;
            if (parse_head(&s->r)) {
                s->in_head = 0;
                size_t extra = s->r.head_len - s->r.raw_start;
                if (extra > s->r.raw_len || s->r.raw_len > slot_bytes) return -1;
                memcpy(input_of(&s->r), s->r.head + s->r.raw_start, extra);
                s->r.raw_got = extra;
            }
        } else {
            size_t want = s->r.raw_len - s->r.raw_got;
            if (len > want) return -1; /* only one raw input in this prototype */
            if (take(c, input_of(&s->r) + s->r.raw_got, len)) return -1;
            s->r.raw_got += len;
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
        memset(s, 0, offsetof(struct stream, r) + offsetof(struct request, head));
        s->used = 1; s->id = sid; s->in_head = 1; s->r.head_len = 0; s->send_window = c->peer_initial;
        s->r.slot = lease_slot();
        if (s->r.slot < 0) return -1;
        return 0;
    }
    case 3: { /* RST_STREAM */
        if (take(c, small, 4)) return -1;
        struct stream *s = find(c, sid);
        if (s && !s->ended) { release_slot(s->r.slot); s->used = 0; }
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

static const unsigned char RESPONSE_BLOCK[] = {
    0x88, 0x0f, 0x10, 16, 'a', 'p', 'p', 'l', 'i', 'c', 'a', 't', 'i', 'o', 'n', '/', 'g', 'r', 'p', 'c'};
static const unsigned char OK_BLOCK[] = {0x00, 11, 'g', 'r', 'p', 'c', '-', 's', 't', 'a', 't', 'u', 's', 1, '0'};

static int answer(struct conn *c, struct stream *s) {
    size_t nbytes = s->r.raw_len;
    int failed = triton_call(c->triton, &s->r);
    if (send_frame(c, 1, 0x4, s->id, RESPONSE_BLOCK, sizeof RESPONSE_BLOCK)) return -1;
    if (failed) {
        static const unsigned char ERR[] = {0x00, 11, 'g', 'r', 'p', 'c', '-', 's', 't', 'a', 't', 'u', 's', 2, '1', '3'};
        return send_frame(c, 1, 0x5, s->id, ERR, sizeof ERR);
    }
    unsigned char pb[1024];
    size_t n = answer_head(&s->r, pb);
    const unsigned char *data = output_of(&s->r);
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
            release_slot(s->r.slot);
            s->used = 0;
            if (bad) goto out;
        }
    }
out:
    for (int i = 0; i < MAX_STREAMS; i++) if (c->streams[i].used) release_slot(c->streams[i].r.slot);
    close(c->triton);
    close(c->fd);
    free(c);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: proto_h2 PORT TRITON_HTTP_PORT SHM_NAME PREFIX SLOTS SLOT_BYTES\n"); return 2; }
    serve_forever(argv, "proto_h2", serve, sizeof(struct conn));
    return 0;
}
