/* The nghttp2 gRPC engine: a stream's headers and its request message (into a buffer, or placed
 * straight into a slot). */
#include "_h2_engine.h"

static PyObject *header_list(struct stream *s);
static int headers_done_locked(Connection *c, struct stream *s);
static int charge(Connection *c, struct stream *s, size_t n);
static void drop_buffer(Connection *c, struct stream *s);
static int buffer_bytes(Connection *c, struct stream *s, const uint8_t *p, size_t n);
static int unplace(Connection *c, struct stream *s, const uint8_t *got, size_t n);
static int place(Connection *c, struct stream *s);
static int place_locked(Connection *c, struct stream *s);
static int place_bytes(Connection *c, struct stream *s, const uint8_t *p, size_t n);

int h2e_refuse(Connection *c, struct stream *s, int status, const char *message, size_t mlen) {
    char st[12];
    int sl = snprintf(st, sizeof st, "%d", status);
    nghttp2_nv nv[4] = {
        {(uint8_t *)":status", (uint8_t *)"200", 7, 3, NGHTTP2_NV_FLAG_NONE},
        {(uint8_t *)"content-type", (uint8_t *)"application/grpc", 12, 16, NGHTTP2_NV_FLAG_NONE},
        {(uint8_t *)"grpc-status", (uint8_t *)st, 11, (size_t)sl, NGHTTP2_NV_FLAG_NONE},
        {(uint8_t *)"grpc-message", (uint8_t *)message, 12, mlen, NGHTTP2_NV_FLAG_NONE},
    };
    s->mode = MODE_REFUSED;
    s->answered = 1;
    return nghttp2_submit_headers(c->session, NGHTTP2_FLAG_END_STREAM, s->id, NULL, nv, mlen ? 4 : 3, NULL) < 0;
}

int h2e_on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    Connection *c = user;
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return NGHTTP2_ERR_CALLBACK_FAILURE;
    s->id = frame->hd.stream_id;
    s->next = c->streams;
    c->streams = s;
    c->nstreams++;
    nghttp2_session_set_stream_user_data(session, s->id, s);
    return 0;
}

int h2e_on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name, size_t namelen,
                     const uint8_t *value, size_t valuelen, uint8_t flags, void *user) {
    (void)flags;
    Connection *c = user;
    if (frame->hd.type != NGHTTP2_HEADERS) return 0;
    struct stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (!s || s->dispatched) return 0; /* trailers of a request: not read */
    size_t need = s->hdr_len + namelen + valuelen + 2;
    if (need > c->max_header_block) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* RST_STREAM */
    if (need > s->hdr_cap) {
        size_t cap = s->hdr_cap ? s->hdr_cap * 2 : 1024;
        while (cap < need) cap *= 2;
        char *p = realloc(s->hdr, cap);
        if (!p) return NGHTTP2_ERR_CALLBACK_FAILURE;
        s->hdr = p;
        s->hdr_cap = cap;
    }
    memcpy(s->hdr + s->hdr_len, name, namelen);
    s->hdr[s->hdr_len + namelen] = 0;
    memcpy(s->hdr + s->hdr_len + namelen + 1, value, valuelen);
    s->hdr[s->hdr_len + namelen + 1 + valuelen] = 0;
    s->hdr_len = need;
    return 0;
}

static PyObject *header_list(struct stream *s) {
    PyObject *list = PyList_New(0);
    size_t at = 0;
    while (list && at < s->hdr_len) {
        size_t nl = strlen(s->hdr + at), vl = strlen(s->hdr + at + nl + 1);
        PyObject *pair = Py_BuildValue("(s#s#)", s->hdr + at, (Py_ssize_t)nl, s->hdr + at + nl + 1, (Py_ssize_t)vl);
        if (!pair || PyList_Append(list, pair)) Py_CLEAR(list);
        Py_XDECREF(pair);
        at += nl + vl + 2;
    }
    return list;
}

/* The handler's say on a stream whose headers have all arrived. */
int h2e_headers_done(Connection *c, struct stream *s) {
    h2e_enter(c);
    int bad = headers_done_locked(c, s);
    h2e_leave(c);
    return bad;
}

static int headers_done_locked(Connection *c, struct stream *s) {
    PyObject *headers = header_list(s);
    PyObject *r = headers ? PyObject_CallMethod(c->handler, "headers", "(iO)", s->id, headers) : NULL;
    Py_XDECREF(headers);
    int mode, status;
    const char *message;
    Py_ssize_t mlen;
    if (!r || !PyArg_ParseTuple(r, "iiy#", &mode, &status, &message, &mlen)) {
        Py_XDECREF(r);
        h2e_keep_error(c);
        return -1;
    }
    int bad = 0;
    if (mode == MODE_REFUSED) bad = h2e_refuse(c, s, status, message, (size_t)mlen);
    else s->mode = mode;
    Py_DECREF(r);
    return bad;
}

/* The request is complete (or ended short of its message: False). */
int h2e_dispatch(Connection *c, struct stream *s) {
    int complete = s->prefix_got == 5 && s->got == s->length;
    s->dispatched = 1;
    h2e_enter(c);
    PyObject *message;
    if (!complete) {
        message = Py_False;
        Py_INCREF(message);
    } else if (s->mode == MODE_PLACE && s->parts) {
        message = Py_None;
        Py_INCREF(message);
        /* every byte is in place: the views of the slot are let go now (a slot is not reused
         * while a view of it lives, and the call may give it back before the stream ends) */
        for (int i = 0; i < s->nparts; i++) PyBuffer_Release(&s->parts[i].buf);
        s->nparts = 0;
    } else if (s->buffer && (size_t)PyByteArray_GET_SIZE(s->buffer) == s->got) {
        message = s->buffer; /* the handler's now: no copy */
        s->buffer = NULL;
        s->data = NULL;
        s->data_cap = 0;
    } else {
        const char *at = (const char *)(s->data ? s->data : s->head);
        message = PyBytes_FromStringAndSize(at ? at : "", (Py_ssize_t)s->got);
    }
    drop_buffer(c, s); /* the handler holds the message now (uncounted, as a running call's) */
    PyObject *r = message ? PyObject_CallMethod(c->handler, "dispatch", "(iOi)", s->id, message, (int)s->prefix[0]) : NULL;
    Py_XDECREF(message);
    int bad = !r;
    if (bad) h2e_keep_error(c);
    if (r && r != Py_None) { /* the handler's request to Triton, for the connection to post */
        const char *host, *data;
        Py_ssize_t dn;
        int port;
        double timeout_s;
        if (!PyArg_ParseTuple(r, "siy#d", &host, &port, &data, &dn, &timeout_s)) {
            h2e_keep_error(c);
            bad = 1;
        } else {
            const char *why = NULL;
            if (h2e_post_unlocked(c, s->id, host, port, data, (size_t)dn, timeout_s, &why)) {
                PyObject *r2 = PyObject_CallMethod(c->handler, "answered", "(iiy)", s->id, -2, why);
                if (!r2) h2e_keep_error(c);
                Py_XDECREF(r2);
            }
        }
    }
    Py_XDECREF(r);
    h2e_leave(c);
    return bad ? -1 : 0;
}

/* Take ``n`` bytes of buffer memory from the handler's budget: 0, or 1 when the budget refuses
 * (the stream is then answered RESOURCE_EXHAUSTED with the handler's message), -1 on an error. */
static int charge(Connection *c, struct stream *s, size_t n) {
    h2e_enter(c);
    PyObject *r = PyObject_CallMethod(c->handler, "charge", "(n)", (Py_ssize_t)n);
    int out = 0;
    if (!r) {
        h2e_keep_error(c);
        out = -1;
    } else if (r != Py_None) {
        const char *m = PyBytes_Check(r) ? PyBytes_AS_STRING(r) : "the server holds too many request bytes at once";
        out = h2e_refuse(c, s, 8, m, strlen(m)) ? -1 : 1;
    } else {
        s->charged += n;
    }
    Py_XDECREF(r);
    h2e_leave(c);
    return out;
}

void h2e_uncharge(Connection *c, struct stream *s) {
    if (!s->charged) return;
    h2e_enter(c);
    PyObject *r = PyObject_CallMethod(c->handler, "uncharge", "(n)", (Py_ssize_t)s->charged);
    if (!r) PyErr_WriteUnraisable(c->handler);
    Py_XDECREF(r);
    h2e_leave(c);
    s->charged = 0;
}

/* The stream's buffer goes back to the handler, to be kept for another message if nothing else
 * refers to it (the GIL held). */
void h2e_give_buffer(Connection *c, struct stream *s) {
    PyObject *b = s->buffer;
    s->buffer = NULL;
    s->data = NULL;
    s->data_cap = 0;
    if (!b) return;
    if (Py_REFCNT(b) == 1) {
        PyObject *r = PyObject_CallMethod(c->handler, "spare", "(O)", b);
        if (!r) PyErr_WriteUnraisable(c->handler);
        Py_XDECREF(r);
    }
    Py_DECREF(b);
}

static void drop_buffer(Connection *c, struct stream *s) {
    if (s->buffer) {
        h2e_enter(c);
        h2e_give_buffer(c, s);
        h2e_leave(c);
    }
    h2e_uncharge(c, s);
}

/* A buffer of ``cap`` to ``limit`` bytes: a kept one from the handler, else a new one made once its
 * bytes are taken from the budget; the message so far copied in, the old one given back. 1: refused. */
static int grow(Connection *c, struct stream *s, size_t cap, size_t limit) {
    h2e_enter(c);
    PyObject *b = PyObject_CallMethod(c->handler, "buffer", "(nn)", (Py_ssize_t)cap, (Py_ssize_t)limit);
    int out = 0;
    if (!b) {
        h2e_keep_error(c);
        out = -1;
    } else if (b != Py_None && (!PyByteArray_Check(b) || (size_t)PyByteArray_GET_SIZE(b) < cap ||
                                (size_t)PyByteArray_GET_SIZE(b) > limit)) {
        PyErr_SetString(PyExc_TypeError, "buffer() must return None or a bytearray of the size asked for");
        h2e_keep_error(c);
        out = -1;
    } else {
        size_t size = b == Py_None ? cap : (size_t)PyByteArray_GET_SIZE(b);
        out = charge(c, s, size - s->data_cap);
        if (!out && b == Py_None) { /* none kept: made now that its bytes are charged */
            Py_DECREF(b);
            b = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)size);
            if (!b) {
                h2e_keep_error(c);
                out = -1;
            }
        }
        if (!out) {
            if (s->got) memcpy(PyByteArray_AS_STRING(b), s->data, s->got);
            h2e_give_buffer(c, s);
            s->buffer = b;
            s->data = (unsigned char *)PyByteArray_AS_STRING(b);
            s->data_cap = size;
            b = NULL;
        }
    }
    Py_XDECREF(b);
    h2e_leave(c);
    return out;
}

/* Buffered message bytes: the buffer grows with what arrives, never by what is announced, each
 * growth taken from the handler's budget first. 1: refused (the stream is answered). */
static int buffer_bytes(Connection *c, struct stream *s, const uint8_t *p, size_t n) {
    if (s->got + n > s->data_cap) {
        size_t cap = s->data_cap ? s->data_cap : 16384;
        while (cap < s->got + n) cap *= 2;
        if (cap > s->length) cap = s->length;
        size_t limit = 2 * cap < s->length ? 2 * cap : s->length;
        int refused = grow(c, s, cap, limit);
        if (refused) {
            drop_buffer(c, s);
            return refused;
        }
    }
    memcpy(s->data + s->got, p, n);
    s->got += n;
    return 0;
}

/* The placement no longer fits the message: the handler gives back what was placed, in a buffer. */
static int unplace(Connection *c, struct stream *s, const uint8_t *got, size_t n) {
    h2e_enter(c);
    for (int i = 0; i < s->nparts; i++) PyBuffer_Release(&s->parts[i].buf);
    free(s->parts);
    s->parts = NULL;
    s->nparts = 0;
    s->mode = MODE_BUFFER;
    PyObject *r = PyObject_CallMethod(c->handler, "unplace", "(iny#)", s->id, (Py_ssize_t)s->placed, got, (Py_ssize_t)n);
    int bad = 0;
    if (!r || !PyBytes_Check(r)) {
        h2e_keep_error(c);
        bad = -1;
    } else {
        s->got = 0;
        bad = buffer_bytes(c, s, (uint8_t *)PyBytes_AS_STRING(r), (size_t)PyBytes_GET_SIZE(r));
    }
    Py_XDECREF(r);
    h2e_leave(c);
    return bad;
}

static int place(Connection *c, struct stream *s) {
    h2e_enter(c);
    int bad = place_locked(c, s);
    h2e_leave(c);
    return bad;
}

static int place_locked(Connection *c, struct stream *s) {
    PyObject *head = PyBytes_FromStringAndSize((char *)s->head, (Py_ssize_t)s->head_len);
    PyObject *r = head ? PyObject_CallMethod(c->handler, "place", "(iOn)", s->id, head, (Py_ssize_t)s->length) : NULL;
    Py_XDECREF(head);
    if (!r) {
        h2e_keep_error(c);
        return -1;
    }
    if (r == Py_None) {
        Py_DECREF(r);
        s->mode = MODE_BUFFER;
        s->got = 0;
        return buffer_bytes(c, s, s->head, s->head_len) < 0 ? -1 : 0;
    }
    PyObject *seq = PySequence_Fast(r, "place() must return a list");
    Py_DECREF(r);
    if (!seq) {
        h2e_keep_error(c);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    s->parts = calloc((size_t)(n ? n : 1), sizeof *s->parts);
    int bad = !s->parts;
    for (Py_ssize_t i = 0; !bad && i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int view = !PyBytes_Check(item);
        if (PyObject_GetBuffer(item, &s->parts[i].buf, view ? PyBUF_WRITABLE : PyBUF_SIMPLE)) bad = 1;
        else {
            s->parts[i].view = view;
            s->nparts++;
        }
    }
    Py_DECREF(seq);
    if (bad) {
        h2e_keep_error(c);
        return -1;
    }
    s->index = 0;
    s->offset = 0;
    s->placed = 0;
    s->got = s->head_len;
    s->place_started = s->place_progress = h2e_now();
    return 0;
}

/* Message bytes of a placed stream: into its views, or checked against its bytes. */
static int place_bytes(Connection *c, struct stream *s, const uint8_t *p, size_t n) {
    while (n) {
        if (s->index == s->nparts) return unplace(c, s, p, n);
        struct part *part = &s->parts[s->index];
        size_t room = (size_t)part->buf.len - s->offset, k = n < room ? n : room;
        if (part->view) {
            memcpy((char *)part->buf.buf + s->offset, p, k);
        } else if (memcmp((char *)part->buf.buf + s->offset, p, k)) {
            return unplace(c, s, p, n);
        }
        s->offset += k;
        s->placed += k;
        s->place_progress = h2e_now();
        s->got += k;
        p += k;
        n -= k;
        if (s->offset == (size_t)part->buf.len) {
            s->index++;
            s->offset = 0;
        }
    }
    return 0;
}

int h2e_on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t stream_id, const uint8_t *data,
                         size_t len, void *user) {
    (void)flags;
    Connection *c = user;
    struct stream *s = nghttp2_session_get_stream_user_data(session, stream_id);
    if (!s || s->mode == MODE_REFUSED || s->dispatched) return 0;
    while (len) {
        if (s->prefix_got < 5) {
            size_t k = 5 - (size_t)s->prefix_got < len ? 5 - (size_t)s->prefix_got : len;
            memcpy(s->prefix + s->prefix_got, data, k);
            s->prefix_got += (int)k;
            data += k;
            len -= k;
            if (s->prefix_got == 5) {
                s->length = (size_t)s->prefix[1] << 24 | (size_t)s->prefix[2] << 16 | (size_t)s->prefix[3] << 8 | s->prefix[4];
                if (s->length > c->max_message) {
                    char m[128];
                    int ml = snprintf(m, sizeof m, "Received message larger than max (%zu vs. %zu)", s->length, c->max_message);
                    if (h2e_refuse(c, s, 8, m, (size_t)ml)) return NGHTTP2_ERR_CALLBACK_FAILURE;
                    return 0;
                }
                if (s->prefix[0]) s->mode = MODE_BUFFER; /* compressed: inflated by the handler */
                s->head_want = s->length < c->head_bytes ? s->length : c->head_bytes;
            }
            continue;
        }
        size_t left = s->length - s->got;
        if (s->mode == MODE_PLACE && s->parts) left = s->length - s->got;
        if (!left) { /* a second message on a unary call */
            if (h2e_refuse(c, s, 13, "more than one request message", 29)) return NGHTTP2_ERR_CALLBACK_FAILURE;
            return 0;
        }
        size_t k = len < left ? len : left;
        int bad = 0;
        if (s->mode == MODE_PLACE && !s->parts) {
            if (!s->head && !(s->head = malloc(s->head_want ? s->head_want : 1))) return NGHTTP2_ERR_CALLBACK_FAILURE;
            size_t h = s->head_want - s->head_len;
            if (k > h) k = h;
            memcpy(s->head + s->head_len, data, k);
            s->head_len += k;
            s->got = s->head_len;
            if (s->head_len == s->head_want) bad = place(c, s);
        } else if (s->mode == MODE_PLACE) {
            bad = place_bytes(c, s, data, k);
        } else {
            bad = buffer_bytes(c, s, data, k);
            if (bad == 1) return 0; /* refused: the rest of its bytes are not read */
        }
        if (bad) return NGHTTP2_ERR_CALLBACK_FAILURE;
        data += k;
        len -= k;
    }
    return 0;
}

/* Messages still arriving into a slot past their time move to memory, and the slot goes back: no
 * bytes for the stall time (the busy one while another call waits for a slot of the pool), or
 * slower overall than the stall time per PLACED_CHUNK. Returns when the next one is due (0: none). */
double h2e_expire_placements(Connection *c, double t, int *bad) {
    double next = 0;
    for (struct stream *s = c->streams; s; s = s->next) {
        if (s->mode != MODE_PLACE || !s->parts || s->index == s->nparts || s->dispatched) continue;
        double scale = 1 + (double)s->length / PLACED_CHUNK, busy_stall = c->slot_busy_stall_s;
        int busy = 0;
        /* whether another call waits for the slot matters only once the busy stall time is past */
        if (busy_stall < c->slot_stall_s && (t >= s->place_progress + busy_stall || t >= s->place_started + busy_stall * scale)) {
            h2e_enter(c);
            PyObject *r = PyObject_CallMethod(c->handler, "slot_wanted", "(i)", s->id);
            busy = r && PyObject_IsTrue(r) == 1;
            if (!r) PyErr_WriteUnraisable(c->handler);
            Py_XDECREF(r);
            h2e_leave(c);
        }
        double stall = busy ? busy_stall : c->slot_stall_s;
        double due = s->place_progress + stall, overall = s->place_started + stall * scale;
        if (overall < due) due = overall;
        if (t >= due) {
            if (unplace(c, s, (const uint8_t *)"", 0) < 0) *bad = 1;
            continue;
        }
        if (!busy && busy_stall < c->slot_stall_s) { /* whether another call waits is looked at again */
            double progress = s->place_progress + busy_stall, started = s->place_started + busy_stall * scale;
            double ask = progress < started ? progress : started;
            if (ask <= t) ask = t + busy_stall;
            if (ask < due) due = ask;
        }
        if (!next || due < next) next = due;
    }
    return next;
}
