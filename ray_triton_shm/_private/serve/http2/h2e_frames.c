/* The nghttp2 gRPC engine: frames that carry no call (budgets, limits, settings, drain) and a
 * stream's end. */
#include "_h2_engine.h"

static int glitch(Connection *c, const char *what);
static int initial_window_changed(Connection *c, const nghttp2_settings *settings);
static void unlink_stream(Connection *c, struct stream *s);

/* A frame that carries no call spends a token; with none left the connection ends (GOAWAY
 * ENHANCE_YOUR_CALM, naming the frame). */
static int glitch(Connection *c, const char *what) {
    double t = h2e_now();
    c->glitch_tokens += (t - c->glitch_at) * c->glitch_rate;
    if (c->glitch_tokens > c->glitch_burst) c->glitch_tokens = c->glitch_burst;
    c->glitch_at = t;
    if (c->glitch_tokens >= 1) {
        c->glitch_tokens -= 1;
        return 0;
    }
    if (c->closing) return 0;
    char why[96];
    int n = snprintf(why, sizeof why, "too many frames without a call (%s)", what);
    c->closing = 1;
    nghttp2_submit_goaway(c->session, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(c->session),
                          NGHTTP2_ENHANCE_YOUR_CALM, (const uint8_t *)why, (size_t)n);
    return 0;
}

/* A header block is counted as its frames arrive, before any of it is decoded: past the limit the
 * connection ends (GOAWAY ENHANCE_YOUR_CALM), its frames unread. */
int h2e_on_begin_frame(nghttp2_session *session, const nghttp2_frame_hd *hd, void *user) {
    (void)session;
    Connection *c = user;
    if (hd->type == NGHTTP2_SETTINGS && !(hd->flags & NGHTTP2_FLAG_ACK)) {
        for (struct stream *s = c->streams; s; s = s->next)
            s->window_before = nghttp2_session_get_stream_remote_window_size(c->session, s->id);
        return 0;
    }
    if (hd->type == NGHTTP2_HEADERS) c->block_len = hd->length;
    else if (hd->type == NGHTTP2_CONTINUATION) c->block_len += hd->length;
    else return 0;
    if (c->block_len <= c->max_header_block || c->closing) return 0;
    char why[96];
    snprintf(why, sizeof why, "a header block over %zu bytes", c->max_header_block);
    c->closing = 1; /* the connection ends once the GOAWAY is out: nothing more of it is read */
    return nghttp2_submit_goaway(c->session, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(c->session),
                                 NGHTTP2_ENHANCE_YOUR_CALM, (const uint8_t *)why, strlen(why))
               ? NGHTTP2_ERR_CALLBACK_FAILURE
               : 0;
}

/* A GOAWAY that ends the connection for an error (ours or nghttp2's) is logged, as the Python
 * engine logs it. */
int h2e_on_frame_send(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    (void)session;
    Connection *c = user;
    if (frame->hd.type != NGHTTP2_GOAWAY || frame->goaway.error_code == NGHTTP2_NO_ERROR) return 0;
    h2e_enter(c);
    const char *why = frame->goaway.opaque_data ? (const char *)frame->goaway.opaque_data : "";
    PyObject *r = PyObject_CallMethod(c->handler, "ended", "(Iy#)", frame->goaway.error_code, why,
                                      (Py_ssize_t)frame->goaway.opaque_data_len);
    if (!r) PyErr_WriteUnraisable(c->handler);
    Py_XDECREF(r);
    h2e_leave(c);
    return 0;
}

/* RFC 9113 6.9.2: a change of SETTINGS_INITIAL_WINDOW_SIZE that takes an open stream's window past
 * 2^31-1 is a connection error FLOW_CONTROL_ERROR (nghttp2 resets only that stream). */
static int initial_window_changed(Connection *c, const nghttp2_settings *settings) {
    int64_t delta = 0;
    for (size_t i = 0; i < settings->niv; i++)
        if (settings->iv[i].settings_id == NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE) {
            delta = (int64_t)settings->iv[i].value - (int64_t)c->peer_initial_window;
            c->peer_initial_window = settings->iv[i].value;
        }
    if (delta <= 0 || c->closing) return 0;
    for (struct stream *s = c->streams; s; s = s->next) {
        if ((int64_t)s->window_before + delta <= NGHTTP2_MAX_WINDOW_SIZE) continue;
        char why[80];
        snprintf(why, sizeof why, "stream %d's window over 2^31-1", s->id);
        c->closing = 1;
        return nghttp2_submit_goaway(c->session, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(c->session),
                                     NGHTTP2_FLOW_CONTROL_ERROR, (const uint8_t *)why, strlen(why))
                   ? NGHTTP2_ERR_CALLBACK_FAILURE
                   : 0;
    }
    return 0;
}

int h2e_on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    Connection *c = user;
    uint8_t flags = frame->hd.flags;
    switch (frame->hd.type) {
    case NGHTTP2_DATA:
        if (!frame->hd.length && !(flags & NGHTTP2_FLAG_END_STREAM)) glitch(c, "empty DATA");
        break;
    case NGHTTP2_SETTINGS:
        if (flags & NGHTTP2_FLAG_ACK) return 0;
        glitch(c, "SETTINGS");
        return initial_window_changed(c, &frame->settings);
    case NGHTTP2_PING:
        if (!(flags & NGHTTP2_FLAG_ACK)) glitch(c, "PING");
        else if (c->go_away == 3 && !memcmp(frame->ping.opaque_data, DRAIN_PING, 8)) {
            c->go_away = 4;
            if (nghttp2_submit_goaway(c->session, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(c->session),
                                      NGHTTP2_NO_ERROR, NULL, 0))
                return NGHTTP2_ERR_CALLBACK_FAILURE;
        }
        return 0;
    case NGHTTP2_RST_STREAM:
        glitch(c, "RST_STREAM");
        return 0;
    case NGHTTP2_PRIORITY:
        glitch(c, "PRIORITY");
        return 0;
    default:
        break;
    }
    if (frame->hd.type != NGHTTP2_DATA && frame->hd.type != NGHTTP2_HEADERS) return 0;
    struct stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (!s) return 0;
    if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST && h2e_headers_done(c, s))
        return NGHTTP2_ERR_CALLBACK_FAILURE;
    if ((frame->hd.flags & NGHTTP2_FLAG_END_STREAM) && s->mode != MODE_REFUSED && !s->dispatched) {
        if (s->prefix_got && s->prefix_got < 5) s->got = 0;
        if (h2e_dispatch(c, s)) return NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    return 0;
}

/* The handler lets go of a stream that ends before its answer: a placement not yet run goes back,
 * a call running is cancelled. */
void h2e_tell_gone(Connection *c, struct stream *s) {
    h2e_enter(c);
    PyObject *r = PyObject_CallMethod(c->handler, "gone", "(i)", s->id);
    if (!r) PyErr_WriteUnraisable(c->handler);
    Py_XDECREF(r);
    h2e_leave(c);
}

static void unlink_stream(Connection *c, struct stream *s) {
    for (struct stream **p = &c->streams; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            c->nstreams--;
            return;
        }
}

int h2e_on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code, void *user) {
    (void)error_code;
    Connection *c = user;
    struct stream *s = nghttp2_session_get_stream_user_data(session, stream_id);
    if (!s) return 0;
    nghttp2_session_set_stream_user_data(session, stream_id, NULL);
    unlink_stream(c, s);
    if (!(s->dispatched && s->answered)) h2e_tell_gone(c, s);
    if (s->answer) { /* its spans may still be in out: released after the next flush */
        s->answer->next = c->done_answers;
        c->done_answers = s->answer;
        s->answer = NULL;
    }
    h2e_stream_free(c, s);
    return 0;
}
