/* A gRPC connection's HTTP/2 side in C, with nghttp2 keeping the protocol's state.
 *
 * nghttp2 reads the frames (HPACK, flow control, SETTINGS, PING, RFC 9113's checks); this
 * module reads the socket, gathers each call's headers and its one request message, and
 * writes the answers, every frame of a send round in one writev. What a call means is
 * Python's: a handler object is asked, with the GIL, at four points of a stream:
 *
 *   handler.headers(stream_id, headers) -> (mode, status, message)
 *       mode 1: the message may be placed (handler.place is asked once its head arrived),
 *       mode 0: it is read into a buffer, mode -1: the call is refused with grpc-status
 *       ``status`` and ``message`` (percent-encoded already).
 *   handler.place(stream_id, head, length) -> list of parts, or None
 *       bytes the message must go on with and writable buffers its bytes go into, in
 *       order (None: a buffer). The handler's placement has taken ``head`` already.
 *   handler.unplace(stream_id, taken, got) -> bytes
 *       the message went on otherwise than placed after ``taken`` more bytes went into
 *       place, then ``got``: the message so far, read on into a buffer.
 *   handler.dispatch(stream_id, message, compressed)
 *       the request is complete: ``message`` (bytes), None when it was placed, False when
 *       the stream ended short of its message; ``compressed``: the message's flag.
 *   handler.gone(stream_id)
 *       the client reset the stream or the connection closed before its answer.
 *
 * and, for what the connection holds and posts:
 *
 *   handler.charge(n) / uncharge(n), charge_unsent(n) / uncharge_unsent(n)
 *       request bytes held in buffers, and answer bytes copied out for a client that took
 *       none of them, taken from (and given back to) the listener's budgets.
 *   handler.buffer(size, limit) -> bytearray / handler.spare(bytearray)
 *       a buffer of ``size`` to ``limit`` bytes for a message read into memory (one kept
 *       from an earlier message, or new), and one given back that nothing else refers to;
 *       a complete message's buffer is dispatch()'s ``message`` itself.
 *   handler.slot_wanted(stream_id)
 *       whether another call waits for a slot of the pool a message is being placed into.
 *   handler.answered(stream_id, code, body)
 *       Triton's answer to a request dispatch() gave the connection to post (HTTP status,
 *       -1: none in time, -2: unreachable); it may give the request to post once more.
 *   handler.ended(code, why)
 *       the connection ends with a GOAWAY for an error.
 *
 * The call's answer comes back through Connection.respond, from any thread. The parts:
 * streams.c (headers and messages), frames.c (frames without a call, a stream's
 * end), send.c (answers), triton.c (requests posted to Triton), this file (the
 * Python type and the connection's loop); _h2_engine.h what they share.
 */
#include "_h2_engine.h"

void h2e_enter(Connection *c) {
    if (c->released && c->depth++ == 0) PyEval_RestoreThread(c->tstate);
}

void h2e_leave(Connection *c) {
    if (c->released && --c->depth == 0) c->tstate = PyEval_SaveThread();
}

struct stream *h2e_find(Connection *c, int32_t id) {
    for (struct stream *s = c->streams; s; s = s->next)
        if (s->id == id) return s;
    return NULL;
}

void h2e_keep_error(Connection *c) {
    if (!c->error && PyErr_Occurred()) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        c->error = value;
    }
    PyErr_Clear();
    c->fatal = 1;
}

double h2e_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int Connection_init(Connection *c, PyObject *args, PyObject *kwargs) {
    static char *kw[] = {"fd", "handler", "max_message", "head_bytes", "max_streams", "window",
                         "glitch_burst", "glitch_rate", "preface_timeout_s", "slot_stall_s", "send_timeout_s",
                         "slot_busy_stall_s", "max_header_block", NULL};
    int fd;
    PyObject *handler;
    Py_ssize_t max_message, head_bytes;
    unsigned int max_streams = 1024, window = 0x7fffffff;
    double glitch_burst = 1000, glitch_rate = 33, preface_timeout_s = 10, slot_stall_s = 1, send_timeout_s = 60;
    double slot_busy_stall_s = 0.1;
    Py_ssize_t max_header_block = MAX_HEADER_BYTES;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOnn|IIddddddn", kw, &fd, &handler, &max_message, &head_bytes,
                                     &max_streams, &window, &glitch_burst, &glitch_rate, &preface_timeout_s,
                                     &slot_stall_s, &send_timeout_s, &slot_busy_stall_s, &max_header_block))
        return -1;
    if (max_header_block < 1) {
        PyErr_SetString(PyExc_ValueError, "max_header_block must be >= 1");
        return -1;
    }
    c->max_header_block = (size_t)max_header_block;
    c->peer_initial_window = NGHTTP2_INITIAL_WINDOW_SIZE;
    c->slot_busy_stall_s = slot_busy_stall_s;
    c->slot_stall_s = slot_stall_s;
    c->send_timeout_s = send_timeout_s;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK)) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    c->glitch_burst = c->glitch_tokens = glitch_burst;
    c->glitch_rate = glitch_rate;
    c->preface_timeout_s = preface_timeout_s;
    c->born = c->glitch_at = h2e_now();
    if (c->session) {
        PyErr_SetString(PyExc_RuntimeError, "Connection already initialised");
        return -1;
    }
    c->fd = fd;
    c->wake[0] = c->wake[1] = -1;
    for (int i = 0; i < MAX_EXCHANGES; i++) c->tx[i].fd = -1;
    Py_INCREF(handler);
    c->handler = handler;
    c->max_message = (size_t)max_message;
    c->head_bytes = (size_t)head_bytes;
    pthread_mutex_init(&c->mu, NULL);
    if (pipe2(c->wake, O_NONBLOCK | O_CLOEXEC)) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    c->rbuf = malloc(READ_BUF);
    if (!c->rbuf) {
        PyErr_NoMemory();
        return -1;
    }
    nghttp2_session_callbacks *cb;
    nghttp2_option *opt;
    if (nghttp2_session_callbacks_new(&cb) || nghttp2_option_new(&opt)) {
        PyErr_NoMemory();
        return -1;
    }
    nghttp2_session_callbacks_set_send_callback(cb, h2e_on_send);
    nghttp2_session_callbacks_set_send_data_callback(cb, h2e_on_send_data);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cb, h2e_on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cb, h2e_on_header);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, h2e_on_data_chunk);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cb, h2e_on_frame_recv);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, h2e_on_stream_close);
    nghttp2_session_callbacks_set_on_begin_frame_callback(cb, h2e_on_begin_frame);
    nghttp2_session_callbacks_set_on_frame_send_callback(cb, h2e_on_frame_send);
    nghttp2_option_set_max_outbound_ack(opt, 1000);
    nghttp2_option_set_max_settings(opt, 32);
    nghttp2_option_set_max_continuations(opt, 8);
    int rv = nghttp2_session_server_new2(&c->session, cb, c, opt);
    nghttp2_session_callbacks_del(cb);
    nghttp2_option_del(opt);
    if (rv) {
        PyErr_SetString(PyExc_RuntimeError, nghttp2_strerror(rv));
        return -1;
    }
    nghttp2_settings_entry settings[] = {
        {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, max_streams},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, window},
        {NGHTTP2_SETTINGS_MAX_FRAME_SIZE, 0xffffff},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, (uint32_t)c->max_header_block},
    };
    if (nghttp2_submit_settings(c->session, NGHTTP2_FLAG_NONE, settings, 4) ||
        nghttp2_session_set_local_window_size(c->session, NGHTTP2_FLAG_NONE, 0, (int32_t)window)) {
        PyErr_SetString(PyExc_RuntimeError, "nghttp2: the settings were refused");
        return -1;
    }
    return 0;
}

static void close_all(Connection *c) {
    pthread_mutex_lock(&c->mu);
    c->closed = 1;
    struct answer *a = c->queue;
    c->queue = c->queue_tail = NULL;
    pthread_mutex_unlock(&c->mu);
    while (a) {
        struct answer *next = a->next;
        h2e_answer_free(c, a);
        a = next;
    }
    c->nout = 0;
    h2e_flush(c);
    while (c->streams) {
        struct stream *s = c->streams;
        c->streams = s->next;
        nghttp2_session_set_stream_user_data(c->session, s->id, NULL);
        if (!(s->dispatched && s->answered)) h2e_tell_gone(c, s);
        h2e_stream_free(c, s);
    }
    c->nstreams = 0;
}

static void Connection_dealloc(Connection *c) {
    if (c->session) {
        close_all(c);
        nghttp2_session_del(c->session);
        pthread_mutex_destroy(&c->mu);
    }
    for (int i = 0; i < MAX_EXCHANGES; i++) {
        h2e_exchange_close(&c->tx[i]);
        free(c->tx[i].buf);
    }
    if (c->wake[0] >= 0) close(c->wake[0]);
    if (c->wake[1] >= 0) close(c->wake[1]);
    free(c->rbuf);
    Py_XDECREF(c->handler);
    Py_XDECREF(c->error);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

PyDoc_STRVAR(run_doc,
    "run(idle_s) -> bool\n\n"
    "Serve the connection until it ends (False: close the socket) or until no call is open and\n"
    "nothing arrives for ``idle_s`` seconds (True: wait for its next bytes elsewhere).");

static PyObject *Connection_run(Connection *c, PyObject *args) {
    double idle_s;
    if (!PyArg_ParseTuple(args, "d", &idle_s)) return NULL;
    if (!c->session) {
        PyErr_SetString(PyExc_RuntimeError, "Connection not initialised");
        return NULL;
    }
    double quiet_since = h2e_now();
    int result = 0;
    c->tstate = PyEval_SaveThread();
    c->released = 1;
    c->depth = 0;
    c->client_closed = 0;
    for (;;) {
        if (!c->client_closed && c->received >= 24) { /* nothing is sent before the client's preface */
            if (h2e_take_answers(c) || nghttp2_session_send(c->session) || h2e_flush(c) || c->fatal) c->client_closed = 1;
            else if (h2e_finish_answers(c) || nghttp2_session_send(c->session) || h2e_flush(c) || c->fatal) c->client_closed = 1;
            else if (c->go_away == 2 && (h2e_take_answers(c) || nghttp2_session_send(c->session) || h2e_flush(c))) c->client_closed = 1;
            else if (c->closing) c->client_closed = 1; /* its GOAWAY is sent */
            else if (!nghttp2_session_want_read(c->session) && !nghttp2_session_want_write(c->session)) c->client_closed = 1;
        }
        if (!c->client_closed && c->received < 24 && h2e_now() - c->born >= c->preface_timeout_s) c->client_closed = 1;
        int waiting = h2e_busy_exchanges(c);
        if (c->client_closed && !waiting) break; /* Triton's answers to a gone client: awaited first */
        int open = c->nstreams > 0 || waiting || (c->blocked && !c->client_closed);
        double t = h2e_now(), wait = open ? 1.0 : idle_s - (t - quiet_since);
        if (c->received < 24) {
            double left = c->preface_timeout_s - (t - c->born);
            wait = left < wait || open ? left : wait;
            open = 1;
        }
        if (!open && wait <= 0) {
            result = 1;
            break;
        }
        struct pollfd p[2 + MAX_EXCHANGES];
        struct exchange *px[2 + MAX_EXCHANGES];
        int np = 0;
        if (!c->client_closed) {
            if (c->blocked && t - c->last_progress >= c->send_timeout_s) { /* took nothing for send_timeout_s */
                c->client_closed = 1;
                continue;
            }
            if (h2e_spill(c, t)) {
                c->client_closed = 1; /* no room left to hold its answers */
                continue;
            }
            double stall = h2e_next_stall(c);
            if (stall && stall - t < wait) wait = stall - t;
            int bad = 0;
            double placing = h2e_expire_placements(c, t, &bad);
            if (bad) {
                c->client_closed = 1;
                continue;
            }
            if (placing && placing - t < wait) wait = placing - t;
            if (c->blocked && c->last_progress + c->send_timeout_s - t < wait) wait = c->last_progress + c->send_timeout_s - t;
        }
        if (!c->client_closed) {
            p[np] = (struct pollfd){c->fd, (short)(POLLIN | (c->blocked ? POLLOUT : 0)), 0};
            px[np++] = NULL;
            p[np] = (struct pollfd){c->wake[0], POLLIN, 0};
            px[np++] = NULL;
        }
        for (int i = 0; i < MAX_EXCHANGES; i++) {
            struct exchange *x = &c->tx[i];
            if (!x->busy) continue;
            if (x->deadline && x->deadline - t < wait) wait = x->deadline - t;
            p[np] = (struct pollfd){x->fd, POLLIN, 0};
            px[np++] = x;
        }
        if (wait < 0) wait = 0;
        int ready = poll(p, (nfds_t)np, (int)(wait * 1000) + 1);
        if (ready < 0 && errno != EINTR) break;
        t = h2e_now();
        for (int i = 0; i < np; i++) {
            struct exchange *x = px[i];
            if (!x || !x->busy) continue;
            if (p[i].revents & (POLLIN | POLLHUP | POLLERR)) {
                if (h2e_exchange_read(c, x)) c->client_closed = 1;
            } else if (x->deadline && t >= x->deadline) {
                x->keep = 0;
                if (h2e_answer_posted(c, x, -1, (const unsigned char *)"", 0)) c->client_closed = 1;
            }
        }
        if (!c->client_closed && ready > 0 && c->blocked && (p[0].revents & POLLOUT) && h2e_flush(c))
            c->client_closed = 1;
        if (!c->client_closed && ready > 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t n = recv(c->fd, c->rbuf, READ_BUF, 0);
            if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (n <= 0) {
                c->client_closed = 1;
                continue;
            }
            quiet_since = t;
            c->received += (size_t)n;
            if (nghttp2_session_mem_recv(c->session, c->rbuf, (size_t)n) < 0 || c->fatal) c->client_closed = 1;
        }
    }
    if (!result) close_all(c);
    PyEval_RestoreThread(c->tstate);
    c->released = 0;
    if (c->error) {
        PyObject *e = c->error;
        c->error = NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(e), e);
        Py_DECREF(e);
        return NULL;
    }
    return PyBool_FromLong(result);
}

PyDoc_STRVAR(respond_doc,
    "respond(stream_id, parts, status, message, release, stall_s=-1) -> bool\n\n"
    "Answer a call, from any thread: its message made of ``parts`` (None: trailers only), then\n"
    "grpc-status ``status`` and ``message`` (bytes, percent-encoded). ``release`` is called once\n"
    "the parts are written or dropped. False: the connection is closed (``release`` not called).");

static PyObject *Connection_respond(Connection *c, PyObject *args) {
    int id, status;
    PyObject *parts, *release;
    const char *message;
    Py_ssize_t mlen;
    double stall = -1;
    if (!PyArg_ParseTuple(args, "iOiy#O|d", &id, &parts, &status, &message, &mlen, &release, &stall)) return NULL;
    struct answer *a = calloc(1, sizeof *a);
    if (!a) return PyErr_NoMemory();
    a->id = id;
    a->status = status;
    a->stall = stall;
    a->message = PyBytes_FromStringAndSize(message, mlen);
    if (!a->message) {
        free(a);
        return NULL;
    }
    if (parts != Py_None) {
        PyObject *seq = PySequence_Fast(parts, "parts must be a list");
        if (!seq) {
            Py_DECREF(a->message);
            free(a);
            return NULL;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        a->parts = calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
        for (Py_ssize_t i = 0; a->parts && i < n; i++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &a->parts[i], PyBUF_SIMPLE)) break;
            a->nparts++;
        }
        Py_DECREF(seq);
        if (!a->parts || a->nparts != n) {
            a->release = NULL;
            h2e_answer_free_locked(a);
            return PyErr_Occurred() ? NULL : PyErr_NoMemory();
        }
    }
    pthread_mutex_lock(&c->mu);
    int closed = c->closed;
    if (!closed) {
        Py_INCREF(release);
        a->release = release;
        if (c->queue_tail) c->queue_tail->next = a;
        else c->queue = a;
        c->queue_tail = a;
    }
    pthread_mutex_unlock(&c->mu);
    if (closed) {
        h2e_answer_free_locked(a); /* release not taken: the caller gives back its memory */
        Py_RETURN_FALSE;
    }
    ssize_t w = write(c->wake[1], "x", 1);
    (void)w;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(go_away_doc, "go_away() -> None\n\nTell the client no new call will be taken (GOAWAY NO_ERROR), from any thread.");

static PyObject *Connection_go_away(Connection *c, PyObject *unused) {
    (void)unused;
    /* the connection's thread sends it: nghttp2's session is its alone */
    ssize_t w = write(c->wake[1], "g", 1);
    (void)w;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(goodbye_doc,
    "goodbye() -> None\n\n"
    "Send GOAWAY (NO_ERROR) on a connection no thread is running (an idle one being closed);\n"
    "nothing waits for the client.");

static PyObject *Connection_goodbye(Connection *c, PyObject *unused) {
    (void)unused;
    if (!c->session || c->released) Py_RETURN_NONE;
    int flags = fcntl(c->fd, F_GETFL);
    if (flags >= 0) fcntl(c->fd, F_SETFL, flags | O_NONBLOCK);
    if (!nghttp2_submit_goaway(c->session, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(c->session),
                               NGHTTP2_NO_ERROR, NULL, 0) &&
        !nghttp2_session_send(c->session))
        h2e_flush(c);
    if (flags >= 0) fcntl(c->fd, F_SETFL, flags);
    Py_RETURN_NONE;
}

static PyObject *Connection_open_streams(Connection *c, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(c->nstreams);
}

static PyMethodDef Connection_methods[] = {
    {"run", (PyCFunction)Connection_run, METH_VARARGS, run_doc},
    {"respond", (PyCFunction)Connection_respond, METH_VARARGS, respond_doc},
    {"go_away", (PyCFunction)Connection_go_away, METH_NOARGS, go_away_doc},
    {"goodbye", (PyCFunction)Connection_goodbye, METH_NOARGS, goodbye_doc},
    {"open_streams", (PyCFunction)Connection_open_streams, METH_NOARGS, "Streams open now (the connection's thread's count)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ConnectionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ray_triton_shm._private.serve.http2._h2_engine.Connection",
    .tp_basicsize = sizeof(Connection),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One gRPC connection served with nghttp2 (see the module's doc).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Connection_init,
    .tp_dealloc = (destructor)Connection_dealloc,
    .tp_methods = Connection_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_h2_engine", "gRPC connections over HTTP/2 with nghttp2.", -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__h2_engine(void) {
    if (PyType_Ready(&ConnectionType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ConnectionType);
    if (PyModule_AddObject(m, "Connection", (PyObject *)&ConnectionType)) {
        Py_DECREF(&ConnectionType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
