/* A measurement prototype, not a server to ship (see measure.py here): proto_h2.c's per-call
 * work with nghttp2 doing the HTTP/2 side. nghttp2 keeps the connection's state (frames, HPACK
 * both ways, flow control, SETTINGS, PING); the callbacks put the request tensor's bytes into a
 * shared-memory slot as they arrive, and the answer's tensor is sent from the slot without a
 * copy (NGHTTP2_DATA_FLAG_NO_COPY: the frame's head and the slot's bytes in one writev). One
 * thread per connection; its calls run one after another, as in proto_h2.c. It keeps no limits
 * and takes one input tensor: it measures what nghttp2 costs against the hand-written framing.
 *
 * Fed from a read buffer, nghttp2 hands each DATA payload over from that buffer, and the payload
 * is copied into the slot. With "zero-copy" as the last argument the reader finds the frames'
 * boundaries itself: the payload of a DATA frame whose bytes belong in a slot is read from the
 * socket straight into the slot, and nghttp2 is fed the frame from there (it keeps the stream's
 * and the connection's flow control); the callback then finds the bytes already in place.
 *
 * usage: proto_nghttp2 PORT TRITON_HTTP_PORT SHM_KEY REGION_PREFIX SLOTS SLOT_BYTES [zero-copy]
 */
#define _GNU_SOURCE
#include <nghttp2/nghttp2.h>

#include "proto_common.h"

#define BUF_SIZE (256 * 1024)
#define MAX_READY 256

static int zero_copy;

struct stream {
    int32_t id;
    int in_head, failed;
    struct request r;
    /* the answer: its message head (prefix and protobuf fields) then the slot's output bytes */
    unsigned char pb[1024];
    size_t pb_len, sent, total;
};

#define OUT_IOV 1024
#define OUT_HEADS 320
#define OUT_STAGED 65536

struct conn {
    int fd, triton;
    nghttp2_session *session;
    /* what one nghttp2_session_send round writes, gathered for one writev: frames nghttp2
     * serialised (copied into staged), DATA frame heads, and spans of the answers' bytes */
    struct iovec out[OUT_IOV];
    unsigned char heads[OUT_HEADS][9];
    unsigned char staged[OUT_STAGED];
    int nout, nheads;
    size_t nstaged;
    /* streams closed since the last flush: their bytes may still be among out's spans */
    struct stream *closed[MAX_READY];
    int nclosed;
    struct stream *open[MAX_READY]; /* nghttp2_session_del closes streams without a callback */
    int nopen;
    int32_t ready[MAX_READY];
    int nready;
};

/* ---- nghttp2 callbacks ---- */

static void forget(struct stream *s) {
    if (s->r.slot >= 0) release_slot(s->r.slot);
    free(s);
}

static int flush(struct conn *c) {
    int bad = c->nout ? send_all(c->fd, c->out, c->nout) : 0;
    c->nout = c->nheads = 0;
    c->nstaged = 0;
    for (int i = 0; i < c->nclosed; i++) forget(c->closed[i]);
    c->nclosed = 0;
    return bad;
}

static ssize_t on_send(nghttp2_session *session, const uint8_t *data, size_t length, int flags, void *user) {
    (void)session; (void)flags;
    struct conn *c = user;
    if (length > OUT_STAGED) {
        struct iovec iov = {(void *)data, length};
        return flush(c) || send_all(c->fd, &iov, 1) ? NGHTTP2_ERR_CALLBACK_FAILURE : (ssize_t)length;
    }
    if ((c->nstaged + length > OUT_STAGED || c->nout == OUT_IOV) && flush(c)) return NGHTTP2_ERR_CALLBACK_FAILURE;
    memcpy(c->staged + c->nstaged, data, length);
    c->out[c->nout++] = (struct iovec){c->staged + c->nstaged, length};
    c->nstaged += length;
    return (ssize_t)length;
}

/* A DATA frame of the answer: its head, then its bytes from the message head and from the slot. */
static int on_send_data(nghttp2_session *session, nghttp2_frame *frame, const uint8_t *framehd, size_t length,
                        nghttp2_data_source *source, void *user) {
    (void)session; (void)frame;
    struct conn *c = user;
    struct stream *s = source->ptr;
    if ((c->nout + 3 > OUT_IOV || c->nheads == OUT_HEADS) && flush(c)) return NGHTTP2_ERR_CALLBACK_FAILURE;
    memcpy(c->heads[c->nheads], framehd, 9);
    c->out[c->nout++] = (struct iovec){c->heads[c->nheads++], 9};
    size_t at = s->sent, left = length;
    if (at < s->pb_len) {
        size_t m = s->pb_len - at < left ? s->pb_len - at : left;
        c->out[c->nout++] = (struct iovec){s->pb + at, m};
        at += m;
        left -= m;
    }
    if (left) c->out[c->nout++] = (struct iovec){output_of(&s->r) + (at - s->pb_len), left};
    s->sent += length;
    return 0;
}

#define NV(n, v) {(uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, sizeof(v) - 1, NGHTTP2_NV_FLAG_NONE}

/* The answer's next DATA frame (sent by on_send_data); the last one queues the trailers (a HEADERS
 * frame submitted earlier would go out before the DATA). */
static ssize_t answer_read(nghttp2_session *session, int32_t stream_id, uint8_t *buf, size_t length,
                           uint32_t *flags, nghttp2_data_source *source, void *user) {
    (void)buf; (void)user;
    static const nghttp2_nv ok[] = {NV("grpc-status", "0")};
    struct stream *s = source->ptr;
    size_t left = s->total - s->sent;  /* what the frames before this one did not take */
    size_t n = left < length ? left : length;
    *flags |= NGHTTP2_DATA_FLAG_NO_COPY;
    if (n == left) {
        *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
        if (nghttp2_submit_trailer(session, stream_id, ok, 1)) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    }
    return (ssize_t)n;
}

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    struct conn *c = user;
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    struct stream *s = c->nopen < MAX_READY ? calloc(1, sizeof *s) : NULL;
    if (!s) return NGHTTP2_ERR_CALLBACK_FAILURE;
    c->open[c->nopen++] = s;
    s->id = frame->hd.stream_id;
    s->in_head = 1;
    s->r.slot = lease_slot();
    if (s->r.slot < 0) s->failed = 1;
    nghttp2_session_set_stream_user_data(session, s->id, s);
    return 0;
}

static int on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name, size_t namelen,
                     const uint8_t *value, size_t valuelen, uint8_t flags, void *user) {
    (void)flags; (void)user;
    static const char PATH[] = "/inference.GRPCInferenceService/ModelInfer";
    if (frame->hd.type != NGHTTP2_HEADERS) return 0;
    struct stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s && namelen == 5 && !memcmp(name, ":path", 5) &&
        (valuelen != sizeof PATH - 1 || memcmp(value, PATH, valuelen)))
        s->failed = 1;
    return 0;
}

static int on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t stream_id, const uint8_t *data,
                         size_t len, void *user) {
    (void)flags; (void)user;
    struct stream *s = nghttp2_session_get_stream_user_data(session, stream_id);
    if (!s || s->failed) return 0;
    while (len) {
        if (s->in_head) {
            size_t room = HEAD_MAX - s->r.head_len, k = len < room ? len : room;
            if (!k) { s->failed = 1; return 0; }
            memcpy(s->r.head + s->r.head_len, data, k);
            s->r.head_len += k;
            data += k;
            len -= k;
            if (parse_head(&s->r)) {
                s->in_head = 0;
                size_t extra = s->r.head_len - s->r.raw_start;
                if (extra > s->r.raw_len || s->r.raw_len > slot_bytes) { s->failed = 1; return 0; }
                memcpy(input_of(&s->r), s->r.head + s->r.raw_start, extra);
                s->r.raw_got = extra;
            }
        } else {
            size_t want = s->r.raw_len - s->r.raw_got;
            if (len > want) { s->failed = 1; return 0; } /* only one raw input in this prototype */
            if (data != input_of(&s->r) + s->r.raw_got) memcpy(input_of(&s->r) + s->r.raw_got, data, len);
            s->r.raw_got += len;
            len = 0;
        }
    }
    return 0;
}

static int on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    struct conn *c = user;
    if ((frame->hd.type == NGHTTP2_DATA || frame->hd.type == NGHTTP2_HEADERS) &&
        (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) &&
        nghttp2_session_get_stream_user_data(session, frame->hd.stream_id) && c->nready < MAX_READY)
        c->ready[c->nready++] = frame->hd.stream_id;
    return 0;
}

/* A closed stream's slot and memory go back after the next flush (its answer may still be in out). */
static int on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code, void *user) {
    (void)error_code;
    struct conn *c = user;
    struct stream *s = nghttp2_session_get_stream_user_data(session, stream_id);
    if (s) {
        nghttp2_session_set_stream_user_data(session, stream_id, NULL);
        for (int i = 0; i < c->nopen; i++)
            if (c->open[i] == s) { c->open[i] = c->open[--c->nopen]; break; }
        if (c->nclosed == MAX_READY && flush(c)) {
            forget(s);
            return NGHTTP2_ERR_CALLBACK_FAILURE;
        }
        c->closed[c->nclosed++] = s;
    }
    return 0;
}

/* ---- the call ---- */

static int answer(struct conn *c, struct stream *s) {
    static const nghttp2_nv head[] = {NV(":status", "200"), NV("content-type", "application/grpc")};
    static const nghttp2_nv failed[] = {NV("grpc-status", "13")};
    if (s->failed || s->in_head || s->r.raw_got != s->r.raw_len || triton_call(c->triton, &s->r)) {
        nghttp2_nv all[] = {head[0], head[1], failed[0]};
        return nghttp2_submit_headers(c->session, NGHTTP2_FLAG_END_STREAM, s->id, NULL, all, 3, NULL) < 0;
    }
    size_t n = answer_head(&s->r, s->pb);
    s->pb_len = n;
    s->total = n + s->r.raw_len;
    s->sent = 0;
    nghttp2_data_provider data = {.source.ptr = s, .read_callback = answer_read};
    return nghttp2_submit_response(c->session, s->id, head, 2, &data) != 0;
}

/* Feed nghttp2 the n bytes read into buf, frame by frame; a DATA payload bound for a slot is read
 * from the socket straight into the slot (what buf holds of it goes through the callback's copy).
 * ``skip``: bytes still to go before the next frame head (the preface, a payload begun). */
static int feed(struct conn *c, unsigned char *buf, size_t n, size_t *skip) {
    size_t at = 0;
    while (at < n) {
        if (*skip) {
            size_t k = n - at < *skip ? n - at : *skip;
            if (nghttp2_session_mem_recv(c->session, buf + at, k) < 0) return -1;
            at += k;
            *skip -= k;
            continue;
        }
        if (n - at < 9) {  /* a frame head split across reads: complete it */
            ssize_t r = recv(c->fd, buf + n, 9 - (n - at), MSG_WAITALL);
            if (r <= 0) return -1;
            n += (size_t)r;
        }
        unsigned char *h = buf + at;
        size_t len = (size_t)h[0] << 16 | (size_t)h[1] << 8 | h[2];
        int32_t sid = (int32_t)(((uint32_t)h[5] << 24 | (uint32_t)h[6] << 16 | (uint32_t)h[7] << 8 | h[8]) & 0x7fffffff);
        if (nghttp2_session_mem_recv(c->session, h, 9) < 0) return -1;
        at += 9;
        size_t here = n - at < len ? n - at : len;
        struct stream *s = h[3] == NGHTTP2_DATA && !(h[4] & NGHTTP2_FLAG_PADDED)
                               ? nghttp2_session_get_stream_user_data(c->session, sid) : NULL;
        if (!s || s->failed || s->in_head || here == len) {
            *skip = len;
            continue;
        }
        if (here && nghttp2_session_mem_recv(c->session, buf + at, here) < 0) return -1;
        at += here;
        size_t rest = len - here;
        if (rest > s->r.raw_len - s->r.raw_got) { *skip = rest; continue; } /* not all for the slot */
        unsigned char *dst = input_of(&s->r) + s->r.raw_got;
        if (recv(c->fd, dst, rest, MSG_WAITALL) != (ssize_t)rest) return -1;
        if (nghttp2_session_mem_recv(c->session, dst, rest) < 0) return -1;
    }
    return 0;
}

static void *serve(void *arg) {
    struct conn *c = arg;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->triton = triton_connect();
    nghttp2_session_callbacks *cb;
    nghttp2_session_callbacks_new(&cb);
    nghttp2_session_callbacks_set_send_callback(cb, on_send);
    nghttp2_session_callbacks_set_send_data_callback(cb, on_send_data);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cb, on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cb, on_header);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, on_data_chunk);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cb, on_frame_recv);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, on_stream_close);
    nghttp2_session_server_new(&c->session, cb, c);
    nghttp2_session_callbacks_del(cb);
    nghttp2_settings_entry settings[] = {
        {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 64},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 0x7fffffff},
        {NGHTTP2_SETTINGS_MAX_FRAME_SIZE, 0xffffff},
    };
    nghttp2_submit_settings(c->session, NGHTTP2_FLAG_NONE, settings, 3);
    nghttp2_session_set_local_window_size(c->session, NGHTTP2_FLAG_NONE, 0, 0x7fffffff);
    unsigned char *buf = malloc(BUF_SIZE + 9);
    if (nghttp2_session_send(c->session) || flush(c)) goto out;
    size_t skip = 24;  /* the client's preface: no frame */
    for (;;) {
        ssize_t n = recv(c->fd, buf, BUF_SIZE, 0);
        if (n <= 0) break;
        if (zero_copy) {
            if (feed(c, buf, (size_t)n, &skip)) break;
        } else if (nghttp2_session_mem_recv(c->session, buf, (size_t)n) < 0) {
            break;
        }
        for (int i = 0; i < c->nready; i++) {
            struct stream *s = nghttp2_session_get_stream_user_data(c->session, c->ready[i]);
            if (s && answer(c, s)) goto out;
        }
        c->nready = 0;
        if (nghttp2_session_send(c->session) || flush(c)) break;
        if (!nghttp2_session_want_read(c->session) && !nghttp2_session_want_write(c->session)) break;
    }
out:
    nghttp2_session_del(c->session); /* closes every stream */
    c->nout = 0;
    flush(c); /* nothing more is written: the closed streams' slots go back */
    for (int i = 0; i < c->nopen; i++) forget(c->open[i]);
    free(buf);
    close(c->triton);
    close(c->fd);
    free(c);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 7 && argc != 8) { fprintf(stderr, "usage: proto_nghttp2 PORT TRITON_HTTP_PORT SHM_NAME PREFIX SLOTS SLOT_BYTES [zero-copy]\n"); return 2; }
    zero_copy = argc == 8 && !strcmp(argv[7], "zero-copy");
    serve_forever(argv, "proto_nghttp2", serve, sizeof(struct conn));
    return 0;
}
