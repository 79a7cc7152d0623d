/* The nghttp2 gRPC engine: answers, from respond() to the socket (one writev per send round), and
 * answers a client takes slowly (copied out of their slots). */
#include "_h2_engine.h"

static int write_out(Connection *c);
static ssize_t answer_read(nghttp2_session *session, int32_t stream_id, uint8_t *buf, size_t length,
                           uint32_t *flags, nghttp2_data_source *source, void *user);
static int start_answer(Connection *c, struct answer *a);
static int budget_call_result(Connection *c, const char *method, size_t n);
static void budget_call(Connection *c, const char *method, size_t n);
static int copy_queued(Connection *c);
static int spill_answer(Connection *c, struct stream *s);
static int spill_written(Connection *c);

void h2e_answer_free_locked(struct answer *a) {
    free(a->heap);
    for (int i = 0; i < a->nparts; i++) PyBuffer_Release(&a->parts[i]);
    free(a->parts);
    if (a->release && a->release != Py_None) {
        PyObject *r = PyObject_CallNoArgs(a->release);
        if (!r) PyErr_WriteUnraisable(a->release);
        Py_XDECREF(r);
    }
    Py_XDECREF(a->release);
    Py_XDECREF(a->message);
    free(a);
}

void h2e_answer_free(Connection *c, struct answer *a) {
    size_t heap = a->heap ? a->heap_len : 0;
    h2e_enter(c);
    h2e_answer_free_locked(a);
    if (heap) {
        PyObject *r = PyObject_CallMethod(c->handler, "uncharge_unsent", "(n)", (Py_ssize_t)heap);
        if (!r) PyErr_WriteUnraisable(c->handler);
        Py_XDECREF(r);
    }
    h2e_leave(c);
}

void h2e_stream_free(Connection *c, struct stream *s) {
    h2e_uncharge(c, s);
    if (s->answer) h2e_answer_free(c, s->answer);
    s->answer = NULL;
    h2e_enter(c);
    for (int i = 0; i < s->nparts; i++) PyBuffer_Release(&s->parts[i].buf);
    h2e_give_buffer(c, s);
    h2e_leave(c);
    free(s->parts);
    free(s->hdr);
    free(s->head);
    free(s);
}

/* Write out as far as the socket takes it now: 0 all of it, 1 the rest waits, -1 failed. */
static int write_out(Connection *c) {
    while (c->nout_from < c->nout) {
        int n = c->nout - c->nout_from;
        ssize_t w = writev(c->fd, c->out + c->nout_from, n > IOV_MAX ? IOV_MAX : n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 1 : -1;
        }
        c->last_progress = h2e_now();
        struct iovec *iov = c->out + c->nout_from;
        while (c->nout_from < c->nout && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            c->nout_from++;
        }
        if (c->nout_from < c->nout) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

/* The send round's frames to the socket. A socket that takes them only in part leaves the rest
 * waiting (blocked): nghttp2 is given no more until it is written. Written whole, the answers
 * whose bytes it held are released. -1: the connection failed. */
int h2e_flush(Connection *c) {
    int r = write_out(c);
    if (r < 0) return -1;
    c->blocked = r;
    if (r) return 0;
    c->nout = c->nout_from = c->nheads = 0;
    c->nstaged = 0;
    c->spill_owned_only = 0;
    if (c->spill) {
        free(c->spill);
        c->spill = NULL;
        budget_call(c, "uncharge_unsent", c->spill_len);
        c->spill_len = 0;
    }
    while (c->done_answers) {
        struct answer *a = c->done_answers;
        c->done_answers = a->next;
        h2e_answer_free(c, a);
    }
    return 0;
}

ssize_t h2e_on_send(nghttp2_session *session, const uint8_t *data, size_t length, int flags, void *user) {
    (void)session; (void)flags;
    Connection *c = user;
    if (c->blocked) return NGHTTP2_ERR_WOULDBLOCK;
    if (c->nstaged + length > OUT_STAGED || c->nout == OUT_IOV) {
        if (h2e_flush(c)) return NGHTTP2_ERR_CALLBACK_FAILURE;
        if (c->blocked) return NGHTTP2_ERR_WOULDBLOCK;
    }
    if (length > OUT_STAGED) { /* nghttp2 serialises a frame at most 16 KiB and a bit: not expected */
        return NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    memcpy(c->staged + c->nstaged, data, length);
    c->out[c->nout++] = (struct iovec){c->staged + c->nstaged, length};
    c->nstaged += length;
    return (ssize_t)length;
}

/* One DATA frame of an answer: its head, then spans of the prefix and the parts, uncopied. */
int h2e_on_send_data(nghttp2_session *session, nghttp2_frame *frame, const uint8_t *framehd, size_t length,
                        nghttp2_data_source *source, void *user) {
    (void)session; (void)frame;
    Connection *c = user;
    struct stream *s = source->ptr;
    struct answer *a = s->answer;
    if (c->blocked) return NGHTTP2_ERR_WOULDBLOCK;
    if (c->nout + 2 + a->nparts > OUT_IOV || c->nheads == OUT_HEADS) {
        if (h2e_flush(c)) return NGHTTP2_ERR_CALLBACK_FAILURE;
        if (c->blocked) return NGHTTP2_ERR_WOULDBLOCK;
    }
    memcpy(c->heads[c->nheads], framehd, 9);
    c->out[c->nout++] = (struct iovec){c->heads[c->nheads++], 9};
    a->progress = h2e_now();
    if (a->heap) { /* copied out of its slot: the rest comes from the copy */
        c->out[c->nout++] = (struct iovec){a->heap + (s->sent - a->heap_from), length};
        s->sent += length;
        return 0;
    }
    size_t at = s->sent, left = length, base = 0;
    if (at < 5) {
        size_t m = 5 - at < left ? 5 - at : left;
        c->out[c->nout++] = (struct iovec){s->msg_prefix + at, m};
        at += m;
        left -= m;
    }
    base = 5;
    for (int i = 0; i < a->nparts && left; i++) {
        size_t len = (size_t)a->parts[i].len;
        if (at < base + len) {
            size_t from = at - base, m = len - from < left ? len - from : left;
            c->out[c->nout++] = (struct iovec){(char *)a->parts[i].buf + from, m};
            at += m;
            left -= m;
        }
        base += len;
    }
    s->sent += length;
    return 0;
}

/* The answer's next DATA frame (written by on_send_data). After the last one the status waits
 * until the message is written and its memory released (finish_answers): a client that has the
 * status finds the slot free. */
static ssize_t answer_read(nghttp2_session *session, int32_t stream_id, uint8_t *buf, size_t length,
                           uint32_t *flags, nghttp2_data_source *source, void *user) {
    (void)session; (void)stream_id; (void)buf; (void)user;
    struct stream *s = source->ptr;
    size_t pending = s->total - s->sent, n = pending < length ? pending : length;
    *flags |= NGHTTP2_DATA_FLAG_NO_COPY;
    if (n == pending) {
        *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
        s->eof = 1;
    }
    return (ssize_t)n;
}

/* Answers whose message is written (flushed): release their memory, then send their status. */
int h2e_finish_answers(Connection *c) {
    int bad = 0;
    if (c->blocked) return 0; /* their bytes are not all written yet */
    for (struct stream *s = c->streams; s; s = s->next) {
        if (!s->eof || !s->answer || s->sent != s->total) continue;
        struct answer *a = s->answer;
        s->answer = NULL;
        s->eof = 0;
        char status[12];
        int sl = snprintf(status, sizeof status, "%d", a->status);
        h2e_enter(c);
        PyObject *message = a->message;
        Py_INCREF(message);
        h2e_leave(c);
        h2e_answer_free(c, a); /* its copy, if any, given back to the unsent budget */
        nghttp2_nv trailers[2] = {
            {(uint8_t *)"grpc-status", (uint8_t *)status, 11, (size_t)sl, NGHTTP2_NV_FLAG_NONE},
            {(uint8_t *)"grpc-message", (uint8_t *)PyBytes_AS_STRING(message), 12,
             (size_t)PyBytes_GET_SIZE(message), NGHTTP2_NV_FLAG_NONE},
        };
        if (nghttp2_submit_trailer(c->session, s->id, trailers, PyBytes_GET_SIZE(message) ? 2 : 1)) bad = 1;
        h2e_enter(c);
        Py_DECREF(message);
        h2e_leave(c);
    }
    return bad;
}

static int start_answer(Connection *c, struct answer *a) {
    struct stream *s = h2e_find(c, a->id);
    if (!s || s->answered) {
        h2e_answer_free(c, a);
        return 0;
    }
    s->answered = 1;
    static const nghttp2_nv head[] = {
        {(uint8_t *)":status", (uint8_t *)"200", 7, 3, NGHTTP2_NV_FLAG_NONE},
        {(uint8_t *)"content-type", (uint8_t *)"application/grpc", 12, 16, NGHTTP2_NV_FLAG_NONE},
        {(uint8_t *)"grpc-accept-encoding", (uint8_t *)"identity,deflate,gzip", 20, 21, NGHTTP2_NV_FLAG_NONE},
    };
    if (!a->parts) {
        int bad = h2e_refuse(c, s, a->status, PyBytes_AS_STRING(a->message), (size_t)PyBytes_GET_SIZE(a->message));
        h2e_answer_free(c, a);
        return bad;
    }
    size_t length = 0;
    for (int i = 0; i < a->nparts; i++) length += (size_t)a->parts[i].len;
    s->answer = a;
    s->msg_prefix[0] = 0;
    s->msg_prefix[1] = (unsigned char)(length >> 24);
    s->msg_prefix[2] = (unsigned char)(length >> 16);
    s->msg_prefix[3] = (unsigned char)(length >> 8);
    s->msg_prefix[4] = (unsigned char)length;
    s->total = length + 5;
    s->sent = 0;
    a->progress = h2e_now();
    nghttp2_data_provider data = {.source.ptr = s, .read_callback = answer_read};
    return nghttp2_submit_response(c->session, s->id, head, 3, &data) != 0;
}

int h2e_take_answers(Connection *c) {
    pthread_mutex_lock(&c->mu);
    struct answer *a = c->queue;
    c->queue = c->queue_tail = NULL;
    pthread_mutex_unlock(&c->mu);
    char drain[64];
    ssize_t got;
    while ((got = read(c->wake[0], drain, sizeof drain)) > 0)
        if (memchr(drain, 'g', (size_t)got) && !c->go_away) c->go_away = 1;
    int bad = 0;
    if (c->go_away == 1) { /* a drain: GOAWAY taking every stream still, and a PING whose acknowledgement
                              * says the client has read it; then the GOAWAY naming the last stream */
        c->go_away = 2;
        bad = nghttp2_submit_shutdown_notice(c->session) != 0;
    } else if (c->go_away == 2 && !nghttp2_session_want_write(c->session)) { /* the GOAWAY is out: now the PING */
        c->go_away = 3;
        bad = nghttp2_submit_ping(c->session, NGHTTP2_FLAG_NONE, DRAIN_PING) != 0;
    }
    while (a) {
        struct answer *next = a->next;
        a->next = NULL;
        if (!bad) bad = start_answer(c, a);
        else h2e_answer_free(c, a);
        a = next;
    }
    return bad;
}

/* handler.<method>(n) for the listener's budget of unsent answer bytes; the result of
 * charge_unsent: 0 taken, 1 refused. */
static int budget_call_result(Connection *c, const char *method, size_t n) {
    h2e_enter(c);
    PyObject *r = PyObject_CallMethod(c->handler, method, "(n)", (Py_ssize_t)n);
    int refused = 0;
    if (!r) PyErr_WriteUnraisable(c->handler);
    else refused = PyObject_IsTrue(r) == 1;
    Py_XDECREF(r);
    h2e_leave(c);
    return refused;
}

static void budget_call(Connection *c, const char *method, size_t n) {
    if (n) budget_call_result(c, method, n);
}

/* The frames queued for the socket, copied into memory of the connection's own (they may point
 * into answers' parts, a slot's included): taken from the unsent budget. -1: no room or memory. */
static int copy_queued(Connection *c) {
    if (c->nout_from >= c->nout || c->spill_owned_only) return 0;
    size_t total = 0;
    for (int i = c->nout_from; i < c->nout; i++) total += c->out[i].iov_len;
    if (budget_call_result(c, "charge_unsent", total)) return -1;
    unsigned char *buf = malloc(total ? total : 1);
    if (!buf) return -1;
    size_t k = 0;
    for (int i = c->nout_from; i < c->nout; i++) {
        memcpy(buf + k, c->out[i].iov_base, c->out[i].iov_len);
        k += c->out[i].iov_len;
    }
    free(c->spill);
    budget_call(c, "uncharge_unsent", c->spill_len);
    c->spill = buf;
    c->spill_len = total;
    c->out[0] = (struct iovec){buf, total};
    c->nout = 1;
    c->nout_from = 0;
    c->nheads = 0;
    c->nstaged = 0;
    c->spill_owned_only = 1;
    return 0;
}

/* An answer its client has taken nothing of for the slot stall time (no window, or a socket that
 * takes nothing): its unsent rest is copied out of its slot (taken from the unsent budget) and
 * the slot goes back. -1: no room (the connection ends). */
static int spill_answer(Connection *c, struct stream *s) {
    struct answer *a = s->answer;
    size_t n = s->total - s->sent;
    if (budget_call_result(c, "charge_unsent", n)) return -1;
    unsigned char *h = malloc(n ? n : 1);
    if (!h) return -1;
    size_t at = s->sent, got = 0, base = 5;
    if (at < 5) {
        memcpy(h, s->msg_prefix + at, 5 - at);
        got = 5 - at;
        at = 5;
    }
    for (int i = 0; i < a->nparts; i++) {
        size_t len = (size_t)a->parts[i].len;
        if (at < base + len) {
            memcpy(h + got, (char *)a->parts[i].buf + (at - base), base + len - at);
            got += base + len - at;
            at = base + len;
        }
        base += len;
    }
    a->heap = h;
    a->heap_from = s->sent;
    a->heap_len = n;
    /* the frames already queued for the socket may point into the parts too: copied first */
    if (copy_queued(c)) return -1;
    h2e_enter(c); /* the parts' memory (a slot) goes back now */
    for (int i = 0; i < a->nparts; i++) PyBuffer_Release(&a->parts[i]);
    a->nparts = 0;
    if (a->release && a->release != Py_None) {
        PyObject *r = PyObject_CallNoArgs(a->release);
        if (!r) PyErr_WriteUnraisable(a->release);
        Py_XDECREF(r);
    }
    Py_CLEAR(a->release);
    h2e_leave(c);
    return 0;
}

/* Answers whose every byte is queued but not written, for a socket that takes nothing: their
 * bytes are copied (see spill_answer) and their memory released. */
static int spill_written(Connection *c) {
    if (!c->done_answers) return 0;
    if (copy_queued(c)) return -1; /* no answer of its own: only the queued frames are copied */
    while (c->done_answers) {
        struct answer *a = c->done_answers;
        c->done_answers = a->next;
        h2e_answer_free(c, a);
    }
    return 0;
}

/* Answers stalled past the slot stall time: copied out of their slots. -1: no room left. */
int h2e_spill(Connection *c, double t) {
    for (struct stream *s = c->streams; s; s = s->next) {
        struct answer *a = s->answer;
        double st = a && a->stall > 0 ? a->stall : c->slot_stall_s;
        if (a && !a->heap && s->sent < s->total && t - a->progress >= st && spill_answer(c, s)) return -1;
    }
    if (c->blocked && t - c->last_progress >= c->slot_stall_s) return spill_written(c);
    return 0;
}

/* When the next answer stalls past the slot stall time (0: none can). */
double h2e_next_stall(Connection *c) {
    double at = 0;
    for (struct stream *s = c->streams; s; s = s->next) {
        struct answer *a = s->answer;
        double st = a && a->stall > 0 ? a->stall : c->slot_stall_s;
        if (a && !a->heap && s->sent < s->total && (!at || a->progress + st < at)) at = a->progress + st;
    }
    if (c->blocked && c->done_answers && (!at || c->last_progress + c->slot_stall_s < at))
        at = c->last_progress + c->slot_stall_s;
    return at;
}
