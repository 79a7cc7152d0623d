/* Runs of HTTP/2 DATA frames read straight into their targets, without the GIL.
 *
 * A client that sends large gRPC messages in frames of 16 KB (the frame size most HTTP/2
 * stacks use: nghttp2, Go, Java) sends 64 DATA frames per MB, and interleaves the frames of
 * the calls it sends at once. `read_data_frames` reads such a run in one call: each frame's
 * head is checked, its payload goes into its stream's target (a shared-memory slot's view)
 * from the connection's read buffer and then straight from the socket. The run stops,
 * leaving the frame unread, at the first frame that is not a plain DATA frame of one of the
 * given streams (another type or stream, END_STREAM, padding, an empty frame) or whose
 * payload does not fit what is left of its target; everything else about such frames is
 * decided by the Python reader (see h2_receive.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

#define FRAME_HEAD 9
#define DATA_TYPE 0
#define END_STREAM_FLAG 0x1
#define PADDED_FLAG 0x8

#define MAX_TARGETS 256

PyDoc_STRVAR(read_data_frames_doc,
    "read_data_frames(fd, buffer, start, end, targets, deadline) -> (start, end, placed, consumed, rest, last)\n"
    "\n"
    "Read consecutive plain DATA frames of the streams of ``targets`` into their views.\n"
    "\n"
    "``targets`` is a sequence of ``(stream_id, writable view)``; a frame goes to the start of\n"
    "what is left of its stream's view. ``buffer[start:end]`` holds the bytes already read from\n"
    "the socket ``fd`` (a blocking socket; its receive timeout ends the run, as does\n"
    "``time.monotonic()`` passing ``deadline`` before a frame). Returns the buffer's new\n"
    "``start`` and ``end``; ``placed``, the bytes written into each view (a list in the order of\n"
    "``targets``); ``consumed``, the payload lengths of the frames begun (for the connection's\n"
    "receive window); ``rest``, how much of the last frame's payload is still to be read (0\n"
    "unless the socket gave no more bytes within its timeout, or closed, in the middle of a\n"
    "frame); and ``last``, the index in ``targets`` of that frame's stream (-1: none begun).");

static PyObject *read_data_frames(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer buffer;
    Py_ssize_t start, end;
    PyObject *targets_arg;
    double deadline;
    if (!PyArg_ParseTuple(args, "iw*nnOd", &fd, &buffer, &start, &end, &targets_arg, &deadline)) return NULL;
    PyObject *targets = PySequence_Fast(targets_arg, "read_data_frames: targets must be a sequence");
    if (!targets) {
        PyBuffer_Release(&buffer);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(targets);
    if (start < 0 || start > end || end > buffer.len || buffer.len < FRAME_HEAD || count > MAX_TARGETS) {
        Py_DECREF(targets);
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_ValueError, "read_data_frames: buffer bounds or target count out of range");
        return NULL;
    }
    unsigned long ids[MAX_TARGETS];
    Py_buffer views[MAX_TARGETS];
    size_t filled[MAX_TARGETS];
    Py_ssize_t ready = 0;
    for (; ready < count; ready++) {
        PyObject *item = PySequence_Fast_GET_ITEM(targets, ready);
        if (!PyArg_ParseTuple(item, "kw*", &ids[ready], &views[ready])) break;
        filled[ready] = 0;
    }
    if (ready < count) {
        for (Py_ssize_t i = 0; i < ready; i++) PyBuffer_Release(&views[i]);
        Py_DECREF(targets);
        PyBuffer_Release(&buffer);
        return NULL;
    }
    unsigned char *buf = buffer.buf;
    size_t cap = (size_t)buffer.len, lo = (size_t)start, hi = (size_t)end, consumed = 0, rest = 0, room = 0;
    Py_ssize_t last = -1;
    for (Py_ssize_t i = 0; i < count; i++) room += (size_t)views[i].len;

    Py_BEGIN_ALLOW_THREADS
    struct timespec now;
    while (room) { /* full targets stop the run: no read waits for a frame that cannot fit */
        clock_gettime(CLOCK_MONOTONIC, &now); /* time.monotonic()'s clock */
        if ((double)now.tv_sec + (double)now.tv_nsec * 1e-9 >= deadline) break;
        if (hi - lo < FRAME_HEAD) {
            if (lo) {
                memmove(buf, buf + lo, hi - lo);
                hi -= lo;
                lo = 0;
            }
            ssize_t n = recv(fd, buf + hi, cap - hi, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break; /* closed, or the receive timeout: the Python reader decides */
            hi += (size_t)n;
            continue;
        }
        const unsigned char *h = buf + lo;
        size_t length = (size_t)h[0] << 16 | (size_t)h[1] << 8 | h[2];
        unsigned long sid = ((unsigned long)h[5] << 24 | (unsigned long)h[6] << 16 | (unsigned long)h[7] << 8 | h[8]) & 0x7fffffffUL;
        if (h[3] != DATA_TYPE || (h[4] & (END_STREAM_FLAG | PADDED_FLAG)) || !length) break;
        Py_ssize_t at = 0;
        while (at < count && ids[at] != sid) at++;
        if (at == count || length > (size_t)views[at].len - filled[at]) break;
        unsigned char *out = (unsigned char *)views[at].buf + filled[at];
        lo += FRAME_HEAD;
        consumed += length;
        room -= length; /* taken now: the frame's whole payload goes into the target */
        last = at;
        size_t have = hi - lo < length ? hi - lo : length;
        memcpy(out, buf + lo, have);
        lo += have;
        filled[at] += have;
        rest = length - have;
        while (rest) {
            ssize_t n = recv(fd, out + have, rest, MSG_WAITALL);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            have += (size_t)n;
            filled[at] += (size_t)n;
            rest -= (size_t)n;
        }
        if (rest) break;
    }
    Py_END_ALLOW_THREADS

    PyObject *placed = PyList_New(count);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
        if (placed) PyList_SET_ITEM(placed, i, PyLong_FromSize_t(filled[i]));
    }
    Py_DECREF(targets);
    PyBuffer_Release(&buffer);
    if (!placed) return NULL;
    return Py_BuildValue("nnNnnn", (Py_ssize_t)lo, (Py_ssize_t)hi, placed, (Py_ssize_t)consumed, (Py_ssize_t)rest,
                         last);
}

static PyMethodDef methods[] = {
    {"read_data_frames", read_data_frames, METH_VARARGS, read_data_frames_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_h2_data", "Runs of HTTP/2 DATA frames read straight into their target.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__h2_data(void) { return PyModule_Create(&module); }
