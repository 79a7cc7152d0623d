/* What the parts of the nghttp2 gRPC engine (_h2_engine.c and *.c) share: its
 * connection, streams, answers and requests to Triton, and the functions one part calls in
 * another (hidden outside the extension). */
#ifndef RTS_H2_ENGINE_H
#define RTS_H2_ENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define READ_BUF (256 * 1024)
#define OUT_IOV 1024
#define OUT_HEADS 320
#define OUT_STAGED 65536
#define MAX_HEADER_BYTES (64 * 1024)

#define MAX_EXCHANGES 64
#define DRAIN_PING ((const uint8_t *)"draining")

enum { MODE_REFUSED = -1, MODE_BUFFER = 0, MODE_PLACE = 1 };

/* A request the connection posts to Triton's HTTP endpoint itself, and its answer. An idle
 * keep-alive socket waits here too (busy 0), for the next request to the same address. */
struct exchange {
    int fd, busy, reused, keep;
    int32_t id;                  /* the stream it answers */
    uint32_t addr;
    int port;
    unsigned char *request;
    size_t request_len;
    unsigned char *buf;
    size_t len, cap, head_end, want;
    int code;
    double deadline;             /* 0: none */
};

struct part {
    int view;        /* 1: a writable buffer to fill; 0: bytes the message must go on with */
    Py_buffer buf;   /* held from place() until the stream ends */
};

struct answer {
    struct answer *next;
    int32_t id;
    int status;
    PyObject *message;   /* bytes: grpc-message, percent-encoded (may be empty) */
    Py_buffer *parts;    /* the answer message's parts (NULL: trailers only) */
    int nparts;
    PyObject *release;   /* called once the parts are written (or dropped), or None */
    unsigned char *heap; /* the message's unsent rest copied out of the parts (a client that stalled) */
    size_t heap_from, heap_len;
    double progress;     /* when its last frame was handed to the socket's queue */
    double stall;        /* how long it may wait on its client before its copy (<= 0: slot_stall_s) */
};

struct stream {
    struct stream *next;
    int32_t id;
    int mode, dispatched, gone, answered, done;
    /* headers as NUL-separated name, value pairs */
    char *hdr;
    size_t hdr_len, hdr_cap;
    /* the message: its 5-byte prefix, then its bytes */
    unsigned char prefix[5];
    int prefix_got;
    size_t length, got;
    unsigned char *head;   /* mode 1: the bytes before place() is asked */
    size_t head_len, head_want;
    struct part *parts;
    int nparts, index;
    size_t offset, placed;     /* within parts[index]; bytes into place since place() */
    double place_started, place_progress; /* when place() gave the parts; when bytes last went in */
    PyObject *buffer;          /* mode 0: the bytearray the message is read into (the handler's) */
    unsigned char *data;       /* its bytes */
    size_t data_cap, charged;  /* charged: bytes of data's memory taken from the handler's budget */
    /* the answer being sent */
    struct answer *answer;
    unsigned char msg_prefix[5];
    size_t total, sent;
    int eof; /* the answer's message is all queued: its status follows once it is written */
    int32_t window_before; /* its send window as a SETTINGS frame from the client began */
};

typedef struct {
    PyObject_HEAD
    int fd, wake[2];
    nghttp2_session *session;
    PyObject *handler;
    size_t max_message;
    size_t head_bytes;
    struct stream *streams;
    int nstreams;
    pthread_mutex_t mu;
    struct answer *queue, *queue_tail; /* answers handed over by respond(), under mu */
    int closed;                        /* under mu: respond() refuses */
    struct answer *done_answers;       /* written: released after the next flush */
    struct iovec out[OUT_IOV];
    unsigned char heads[OUT_HEADS][9];
    unsigned char staged[OUT_STAGED];
    int nout, nheads, nout_from;
    size_t nstaged;
    int blocked;                       /* the socket took no more: out waits for POLLOUT */
    double last_progress;              /* when the socket last took bytes */
    unsigned char *spill;              /* out's unsent bytes, copied when the client stalled */
    size_t spill_len;
    double slot_stall_s, send_timeout_s, slot_busy_stall_s;
    int spill_owned_only;              /* out holds only the spill (copied already) */
    unsigned char *rbuf;
    PyObject *error;                   /* an exception a callback raised, re-raised by run() */
    int fatal;
    /* run() serves without the GIL: what calls Python takes it (enter/leave, nested) */
    PyThreadState *tstate;
    int released, depth;
    int go_away;
    struct exchange tx[MAX_EXCHANGES];
    int client_closed;            /* the client's side ended: only Triton's answers are awaited */
    /* frames that carry no call: a token bucket of glitch_burst, refilled glitch_rate a second */
    double glitch_burst, glitch_rate, glitch_tokens, glitch_at;
    int closing;                  /* a GOAWAY ending the connection is queued: close once it is sent */
    double preface_timeout_s, born;
    size_t received;              /* bytes read from the client (its preface is the first 24) */
    size_t max_header_block;      /* longest header block accepted (counted before it is decoded) */
    size_t block_len;             /* the header block being received so far */
    uint32_t peer_initial_window; /* the client's SETTINGS_INITIAL_WINDOW_SIZE */
} Connection;
#define PLACED_CHUNK (4.0 * 1024 * 1024)

#pragma GCC visibility push(hidden)
void h2e_enter(Connection *c);
void h2e_leave(Connection *c);
struct stream *h2e_find(Connection *c, int32_t id);
void h2e_keep_error(Connection *c);
void h2e_answer_free_locked(struct answer *a);
void h2e_answer_free(Connection *c, struct answer *a);
void h2e_stream_free(Connection *c, struct stream *s);
int h2e_flush(Connection *c);
ssize_t h2e_on_send(nghttp2_session *session, const uint8_t *data, size_t length, int flags, void *user);
int h2e_on_send_data(nghttp2_session *session, nghttp2_frame *frame, const uint8_t *framehd, size_t length,
                     nghttp2_data_source *source, void *user);
int h2e_finish_answers(Connection *c);
int h2e_refuse(Connection *c, struct stream *s, int status, const char *message, size_t mlen);
int h2e_on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user);
int h2e_on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name, size_t namelen,
                  const uint8_t *value, size_t valuelen, uint8_t flags, void *user);
int h2e_headers_done(Connection *c, struct stream *s);
int h2e_dispatch(Connection *c, struct stream *s);
void h2e_uncharge(Connection *c, struct stream *s);
void h2e_give_buffer(Connection *c, struct stream *s);
int h2e_on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t stream_id, const uint8_t *data,
                      size_t len, void *user);
int h2e_on_begin_frame(nghttp2_session *session, const nghttp2_frame_hd *hd, void *user);
int h2e_on_frame_send(nghttp2_session *session, const nghttp2_frame *frame, void *user);
int h2e_on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user);
void h2e_tell_gone(Connection *c, struct stream *s);
int h2e_on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code, void *user);
int h2e_take_answers(Connection *c);
int h2e_spill(Connection *c, double t);
double h2e_next_stall(Connection *c);
double h2e_expire_placements(Connection *c, double t, int *bad);
void h2e_exchange_close(struct exchange *x);
int h2e_post(Connection *c, int32_t id, const char *host, int port, const char *data, size_t n, double timeout_s,
                const char **why);
int h2e_exchange_read(Connection *c, struct exchange *x);
int h2e_answer_posted(Connection *c, struct exchange *x, int code, const unsigned char *body, size_t n);
int h2e_post_unlocked(Connection *c, int32_t id, const char *host, int port, const char *data, size_t n,
                      double timeout_s, const char **why);
int h2e_busy_exchanges(Connection *c);
double h2e_now(void);
#pragma GCC visibility pop

#endif
