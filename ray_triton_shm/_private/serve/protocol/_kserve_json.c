/*
 * KServe v2 JSON tensors in C: a strict JSON reader that keeps the numbers of a
 * "data" array in one flat buffer instead of one Python object each, and the
 * writer of a numeric array as the JSON text `json.dumps(array.tolist())` gives.
 *
 * The reader accepts a subset of what Python's json module accepts and gives
 * the same values: numbers are converted by CPython's own routines
 * (PyOS_string_to_double, as float() does), keys and strings are decoded as
 * strict UTF-8. Anything outside that subset (escapes in strings, a key given
 * twice, NaN, numbers past a double or of more than 18 integer digits, nesting
 * deeper than MAX_DEPTH, malformed text) makes `loads` return its `fallback`
 * argument: the caller then parses the text with the json module, whose answer
 * (or error) is the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 256
#define MAX_NUMBER_CHARS 64
/* Integers of up to this magnitude convert to a double exactly. */
#define EXACT_INT (INT64_C(1) << 53)

typedef struct {
    const char *p;
    const char *end;
    PyObject *numbers; /* called as numbers(bytearray, kind) for "data" arrays; NULL: lists */
    int fallback;      /* set (with no Python error) when the json module must decide */
    int depth;
    int fast; /* the long double fast paths may be used (see extended_precision) */
} Reader;

static PyObject *read_value(Reader *r, int is_data);

static PyObject *give_up(Reader *r) {
    r->fallback = 1;
    return NULL;
}

static void skip_ws(Reader *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) {
        r->p++;
    }
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Scans one JSON number at r->p. Returns 0 and fills *start, *len, *is_float; -1 if malformed. */
static int scan_number(Reader *r, const char **start, Py_ssize_t *len, int *is_float) {
    const char *p = r->p, *end = r->end;
    *start = p;
    *is_float = 0;
    if (p < end && *p == '-') {
        p++;
    }
    if (p < end && *p == '0') {
        p++;
    } else if (p < end && *p >= '1' && *p <= '9') {
        while (p < end && is_digit(*p)) {
            p++;
        }
    } else {
        return -1;
    }
    if (p < end && *p == '.') {
        p++;
        if (!(p < end && is_digit(*p))) {
            return -1;
        }
        while (p < end && is_digit(*p)) {
            p++;
        }
        *is_float = 1;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-')) {
            p++;
        }
        if (!(p < end && is_digit(*p))) {
            return -1;
        }
        while (p < end && is_digit(*p)) {
            p++;
        }
        *is_float = 1;
    }
    *len = p - *start;
    r->p = p;
    return 0;
}

/* The integer of an integer literal of at most 18 digits. Returns -1 past that. */
static int integer_of(const char *s, Py_ssize_t len, int64_t *out) {
    int neg = s[0] == '-';
    Py_ssize_t digits = len - neg;
    if (digits > 18) {
        return -1;
    }
    int64_t v = 0;
    for (Py_ssize_t i = neg; i < len; i++) {
        v = v * 10 + (s[i] - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

#if (defined(__x86_64__) || defined(__i386__)) && LDBL_MANT_DIG == 64
#define HAVE_X87_FAST_PATH 1
/* Powers of ten that an x87 long double (64-bit significand) holds exactly: 10^27 = 2^27 * 5^27. */
#define MAX_FAST_EXP 27
static long double powers_of_ten[MAX_FAST_EXP + 1];

/* Whether long double arithmetic has its 64-bit significand now (the x87 precision control
 * at extended, as Linux sets it): the fast paths rely on it, and are not used otherwise. */
static int extended_precision(void) {
    volatile long double one = 1.0L, tiny = 1.0L / 9223372036854775808.0L; /* 2^-63 */
    return one + tiny != one;
}

static void init_powers(void) {
    /* 10^k = 5^k * 2^k: 5^27 fits 64 bits, so each is exact whatever the precision control says. */
    uint64_t five = 1;
    for (int k = 0; k <= MAX_FAST_EXP; k++) {
        powers_of_ten[k] = ldexpl((long double)five, k);
        five *= 5;
    }
}

/*
 * The double nearest w * 10^scale (w < 2^64), from one long double multiply or divide with exact
 * operands (rounded once, to 64 bits) and its rounding to 53 bits. The two roundings agree with
 * one correct rounding unless the 64-bit result lies exactly on a midpoint between two doubles
 * (its 11 low bits 0x400): then, as when the scale is too large, it returns -1.
 */
static int scaled_double(uint64_t w, int scale, int neg, double *out) {
    if (w == 0) {
        *out = neg ? -0.0 : 0.0;
        return 0;
    }
    if (scale > MAX_FAST_EXP || scale < -MAX_FAST_EXP) {
        return -1;
    }
    volatile long double v = (long double)w;
    if (scale >= 0) {
        v = v * powers_of_ten[scale];
    } else {
        v = v / powers_of_ten[-scale];
    }
    long double exact = v;
    uint64_t mantissa;
    memcpy(&mantissa, (const void *)&exact, sizeof mantissa); /* the 64-bit significand, top bit explicit */
    if ((mantissa & 0x7FF) == 0x400) {
        return -1;
    }
    double d = (double)exact;
    *out = neg ? -d : d;
    return 0;
}

/*
 * The double nearest a decimal of at most 19 significant digits and a small exponent,
 * from one exact-operand long double multiply or divide (rounded once, to 64 bits) and
 * its rounding to 53 bits. The two roundings agree with one correct rounding unless the
 * 64-bit result lies exactly on a midpoint between two doubles (its 11 low bits 0x400):
 * then, as when the digits do not fit, it returns -1 and float()'s own routine decides.
 */
static int fast_double(const char *s, Py_ssize_t len, double *out) {
    uint64_t w = 0;
    int digits = 0, frac = 0, exp = 0, neg = 0, in_frac = 0;
    Py_ssize_t i = 0;
    if (s[0] == '-') {
        neg = 1;
        i = 1;
    }
    for (; i < len; i++) {
        char c = s[i];
        if (c == '.') {
            in_frac = 1;
            continue;
        }
        if (c == 'e' || c == 'E') {
            break;
        }
        if (digits || c != '0') {
            if (++digits > 19) {
                return -1;
            }
            w = w * 10 + (uint64_t)(c - '0');
        }
        frac += in_frac;
    }
    if (i < len) { /* the exponent */
        int eneg = 0, e = 0;
        i++;
        if (s[i] == '+' || s[i] == '-') {
            eneg = s[i] == '-';
            i++;
        }
        for (; i < len; i++) {
            if (e > 10000) {
                return -1;
            }
            e = e * 10 + (s[i] - '0');
        }
        exp = eneg ? -e : e;
    }
    if (w == 0) {
        *out = neg ? -0.0 : 0.0;
        return 0;
    }
    return scaled_double(w, exp - frac, neg, out);
}

static const uint64_t pow10_u64[20] = {1ULL,
                                       10ULL,
                                       100ULL,
                                       1000ULL,
                                       10000ULL,
                                       100000ULL,
                                       1000000ULL,
                                       10000000ULL,
                                       100000000ULL,
                                       1000000000ULL,
                                       10000000000ULL,
                                       100000000000ULL,
                                       1000000000000ULL,
                                       10000000000000ULL,
                                       100000000000000ULL,
                                       1000000000000000ULL,
                                       10000000000000000ULL,
                                       100000000000000000ULL,
                                       1000000000000000000ULL,
                                       10000000000000000000ULL};

/* Whether |x| * 10^scale, rounded to an integer, is decided by its long double value: returns the
 * integer, or -1 when the fraction lies within 2^-7 of a half (the long double's error is 2^-8 at most). */
static int round_scaled(double x, int scale, uint64_t *n, long double *rest) {
    volatile long double v = (long double)x;
    if (scale >= 0) {
        v = v * powers_of_ten[scale];
    } else {
        v = v / powers_of_ten[-scale];
    }
    long double whole = floorl(v);
    long double frac = v - whole;
    if (fabsl(frac - 0.5L) < 1.0L / 128) {
        return -1;
    }
    uint64_t i = (uint64_t)whole;
    if (frac > 0.5L) {
        i++;
        frac -= 1.0L;
    }
    *n = i;
    *rest = frac; /* the value minus the integer, in [-0.5, 0.5] */
    return 0;
}

/*
 * repr(x) for a finite, non-zero double of magnitude between 1e-10 and 1e42: the fewest
 * significant digits that read back as x, nearest x (what float.__repr__ gives), laid out as
 * float.__repr__ lays them out. Returns the length written to out, or -1 when a rounding is
 * too close to call (float.__repr__ then writes it).
 */
static int fast_repr(double x, char *out) {
    double a = fabs(x);
    if (!(a >= 1e-10 && a <= 1e42)) {
        return -1;
    }
    int e10 = (int)floor(log10(a));
    uint64_t n17;
    long double rest;
    for (int tries = 0;; tries++) { /* 17 significant digits: 10^16 <= n17 < 10^17 */
        if (tries == 2 || 16 - e10 > MAX_FAST_EXP || 16 - e10 < -MAX_FAST_EXP) {
            return -1;
        }
        if (round_scaled(a, 16 - e10, &n17, &rest) < 0) {
            return -1;
        }
        if (n17 < pow10_u64[16]) {
            e10--;
        } else if (n17 >= pow10_u64[17]) {
            e10++;
        } else {
            break;
        }
    }
    /* Fewer digits while they still read back as x; each rounding taken from the exact remainder. */
    uint64_t best = n17;
    int best_digits = 17, best_decpt = e10 + 1;
    for (int k = 1; k < 17; k++) {
        uint64_t unit = pow10_u64[k], q = n17 / unit, r = n17 % unit, half = unit / 2;
        if (r == half) { /* the remainder's sign decides, where the long double is sure of it */
            if (fabsl(rest) < 1.0L / 128) {
                return -1;
            }
            q += rest > 0;
        } else if (r > half) {
            q++;
        }
        int digits = 17 - k, decpt = e10 + 1;
        if (q == pow10_u64[digits]) { /* 9.99 rounded up to 10.0 */
            q /= 10;
            decpt++;
        }
        double back;
        if (scaled_double(q, decpt - digits, 0, &back) < 0) {
            return -1;
        }
        if (back != a) {
            break;
        }
        best = q;
        best_digits = digits;
        best_decpt = decpt;
    }
    char digits[20];
    int n = 0;
    for (int i = best_digits - 1; i >= 0; i--) {
        digits[i] = (char)('0' + best % 10);
        best /= 10;
    }
    n = best_digits;
    while (n > 1 && digits[n - 1] == '0') {
        n--;
    }
    int decpt = best_decpt, len = 0;
    if (x < 0) {
        out[len++] = '-';
    }
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            out[len++] = '0';
            out[len++] = '.';
            for (int i = 0; i < -decpt; i++) {
                out[len++] = '0';
            }
            memcpy(out + len, digits, (size_t)n);
            len += n;
        } else if (decpt >= n) {
            memcpy(out + len, digits, (size_t)n);
            len += n;
            for (int i = n; i < decpt; i++) {
                out[len++] = '0';
            }
            out[len++] = '.';
            out[len++] = '0';
        } else {
            memcpy(out + len, digits, (size_t)decpt);
            len += decpt;
            out[len++] = '.';
            memcpy(out + len, digits + decpt, (size_t)(n - decpt));
            len += n - decpt;
        }
    } else {
        out[len++] = digits[0];
        if (n > 1) {
            out[len++] = '.';
            memcpy(out + len, digits + 1, (size_t)(n - 1));
            len += n - 1;
        }
        int e = decpt - 1;
        out[len++] = 'e';
        out[len++] = e < 0 ? '-' : '+';
        e = e < 0 ? -e : e;
        if (e >= 100) {
            out[len++] = (char)('0' + e / 100);
        }
        out[len++] = (char)('0' + (e / 10) % 10);
        out[len++] = (char)('0' + e % 10);
    }
    return len;
}
#else
static int extended_precision(void) { return 0; }
static void init_powers(void) {}
#endif

/*
 * The double of a float literal, as float() reads it. Returns -1 if too long or not finite.
 * With ``save`` (the GIL released by this thread), float()'s own routine, where it is needed,
 * runs with the GIL taken back for it.
 */
static int double_of(const char *s, Py_ssize_t len, double *out, PyThreadState **save, int fast) {
    char text[MAX_NUMBER_CHARS + 1];
    if (len > MAX_NUMBER_CHARS) {
        return -1;
    }
#ifdef HAVE_X87_FAST_PATH
    if (fast && fast_double(s, len, out) == 0) {
        return 0;
    }
#endif
    memcpy(text, s, (size_t)len);
    text[len] = '\0';
    char *stop = NULL;
    if (save != NULL) {
        PyEval_RestoreThread(*save);
    }
    double v = PyOS_string_to_double(text, &stop, NULL);
    int failed = v == -1.0 && PyErr_Occurred();
    if (failed) {
        PyErr_Clear();
    }
    if (save != NULL) {
        *save = PyEval_SaveThread();
    }
    if (failed || stop != text + len || !isfinite(v)) {
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *read_number(Reader *r) {
    const char *s;
    Py_ssize_t len;
    int is_float;
    if (scan_number(r, &s, &len, &is_float) < 0) {
        return give_up(r);
    }
    if (is_float) {
        double v;
        if (double_of(s, len, &v, NULL, r->fast) < 0) {
            return give_up(r);
        }
        return PyFloat_FromDouble(v);
    }
    int64_t i;
    if (integer_of(s, len, &i) < 0) {
        return give_up(r);
    }
    return PyLong_FromLongLong((long long)i);
}

static PyObject *read_string(Reader *r) {
    const char *start = ++r->p; /* past the opening quote */
    while (r->p < r->end) {
        unsigned char c = (unsigned char)*r->p;
        if (c == '"') {
            PyObject *s = PyUnicode_DecodeUTF8(start, r->p - start, "strict");
            r->p++;
            if (s == NULL) {
                if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                    PyErr_Clear();
                    return give_up(r);
                }
            }
            return s;
        }
        if (c == '\\' || c < 0x20) {
            return give_up(r);
        }
        r->p++;
    }
    return give_up(r);
}

/*
 * A "data" array of plain numbers, read into one bytearray: int64 while every
 * element is an integer ("q"), else doubles ("d"; integers must then convert
 * exactly). The bytearray grows with the numbers read (never sized by the commas
 * alone), and the numbers are read with the GIL released. Returns NULL with
 * r->fallback clear and no error when the array is not such an array (the caller
 * reads it as a list), or r->fallback set, or an error set.
 */
static PyObject *read_numbers(Reader *r) {
    const char *p = r->p + 1;
    Py_ssize_t commas = 0;
    int any = 0;
    for (; p < r->end && *p != ']'; p++) {
        char c = *p;
        if (c == ',') {
            commas++;
        } else if (is_digit(c) || c == '-') {
            any = 1;
        } else if (!(c == '.' || c == 'e' || c == 'E' || c == '+' || c == ' ' || c == '\t' || c == '\n' ||
                     c == '\r')) {
            return NULL; /* strings, constants or nested arrays: a list */
        }
    }
    if (p >= r->end || !any) {
        return NULL;
    }
    Py_ssize_t room = commas + 1; /* elements, if the array is well formed */
    Py_ssize_t cap = room < 65536 ? room : 65536;
    PyObject *buffer = PyByteArray_FromStringAndSize(NULL, cap * 8);
    if (buffer == NULL) {
        return NULL; /* MemoryError */
    }
    char *base = PyByteArray_AS_STRING(buffer);
    int floats = 0, status = 0; /* 0 read, 1 malformed (the json module decides), -1 an error */
    Py_ssize_t n = 0;
    r->p++; /* past '[' */
    PyThreadState *save = PyEval_SaveThread();
    for (;;) {
        skip_ws(r);
        const char *s;
        Py_ssize_t len;
        int is_float;
        if (n >= room || scan_number(r, &s, &len, &is_float) < 0) {
            status = 1;
            break;
        }
        if (n == cap) {
            Py_ssize_t grown = cap > room / 2 ? room : cap * 2;
            PyEval_RestoreThread(save);
            int failed = PyByteArray_Resize(buffer, grown * 8);
            save = PyEval_SaveThread();
            if (failed) {
                status = -1;
                break;
            }
            cap = grown;
            base = PyByteArray_AS_STRING(buffer);
        }
        int64_t *ints = (int64_t *)base;
        double *doubles = (double *)base;
        if (is_float) {
            double v;
            if (double_of(s, len, &v, &save, r->fast) < 0) {
                status = 1;
                break;
            }
            if (!floats) {
                for (Py_ssize_t k = 0; k < n; k++) {
                    int64_t i = ints[k];
                    if (i > EXACT_INT || i < -EXACT_INT) {
                        status = 1;
                        break;
                    }
                    doubles[k] = (double)i;
                }
                if (status) {
                    break;
                }
                floats = 1;
            }
            doubles[n++] = v;
        } else {
            int64_t i;
            if (integer_of(s, len, &i) < 0 || (floats && (i > EXACT_INT || i < -EXACT_INT))) {
                status = 1;
                break;
            }
            if (floats) {
                doubles[n++] = (double)i;
            } else {
                ints[n++] = i;
            }
        }
        skip_ws(r);
        if (r->p < r->end && *r->p == ',') {
            r->p++;
            continue;
        }
        if (r->p < r->end && *r->p == ']') {
            r->p++;
            break;
        }
        status = 1;
        break;
    }
    PyEval_RestoreThread(save);
    if (status == 0 && n != room) {
        status = 1;
    }
    if (status == 0 && n != cap && PyByteArray_Resize(buffer, n * 8) < 0) {
        status = -1;
    }
    if (status != 0) {
        Py_DECREF(buffer);
        return status > 0 ? give_up(r) : NULL;
    }
    PyObject *result = PyObject_CallFunction(r->numbers, "Os", buffer, floats ? "d" : "q");
    Py_DECREF(buffer);
    return result;
}

static PyObject *read_array(Reader *r, int is_data) {
    if (is_data && r->numbers != NULL) {
        PyObject *numbers = read_numbers(r);
        if (numbers != NULL || r->fallback || PyErr_Occurred()) {
            return numbers;
        }
    }
    PyObject *list = PyList_New(0);
    if (list == NULL) {
        return NULL;
    }
    r->p++; /* past '[' */
    skip_ws(r);
    if (r->p < r->end && *r->p == ']') {
        r->p++;
        return list;
    }
    for (;;) {
        PyObject *item = read_value(r, 0);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        int failed = PyList_Append(list, item);
        Py_DECREF(item);
        if (failed) {
            Py_DECREF(list);
            return NULL;
        }
        skip_ws(r);
        if (r->p < r->end && *r->p == ',') {
            r->p++;
            continue;
        }
        if (r->p < r->end && *r->p == ']') {
            r->p++;
            return list;
        }
        Py_DECREF(list);
        return give_up(r);
    }
}

static PyObject *read_object(Reader *r) {
    PyObject *dict = PyDict_New();
    if (dict == NULL) {
        return NULL;
    }
    r->p++; /* past '{' */
    skip_ws(r);
    if (r->p < r->end && *r->p == '}') {
        r->p++;
        return dict;
    }
    for (;;) {
        skip_ws(r);
        if (!(r->p < r->end && *r->p == '"')) {
            goto fail_give_up;
        }
        PyObject *key = read_string(r);
        if (key == NULL) {
            goto fail;
        }
        int known = PyDict_Contains(dict, key);
        if (known != 0) { /* a key given twice: the json module's refusal */
            Py_DECREF(key);
            if (known < 0) {
                goto fail;
            }
            goto fail_give_up;
        }
        skip_ws(r);
        if (!(r->p < r->end && *r->p == ':')) {
            Py_DECREF(key);
            goto fail_give_up;
        }
        r->p++;
        int is_data = PyUnicode_CompareWithASCIIString(key, "data") == 0;
        PyObject *value = read_value(r, is_data);
        if (value == NULL) {
            Py_DECREF(key);
            goto fail;
        }
        int failed = PyDict_SetItem(dict, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (failed) {
            goto fail;
        }
        skip_ws(r);
        if (r->p < r->end && *r->p == ',') {
            r->p++;
            continue;
        }
        if (r->p < r->end && *r->p == '}') {
            r->p++;
            return dict;
        }
        goto fail_give_up;
    }
fail_give_up:
    r->fallback = 1;
fail:
    Py_DECREF(dict);
    return NULL;
}

static int literal(Reader *r, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(r->end - r->p) < n || memcmp(r->p, word, n) != 0) {
        return 0;
    }
    r->p += n;
    return 1;
}

static PyObject *read_value(Reader *r, int is_data) {
    skip_ws(r);
    if (r->p >= r->end) {
        return give_up(r);
    }
    if (++r->depth > MAX_DEPTH) {
        return give_up(r);
    }
    PyObject *value;
    char c = *r->p;
    if (c == '{') {
        value = read_object(r);
    } else if (c == '[') {
        value = read_array(r, is_data);
    } else if (c == '"') {
        value = read_string(r);
    } else if (c == '-' || is_digit(c)) {
        value = read_number(r);
    } else if (literal(r, "true")) {
        value = Py_NewRef(Py_True);
    } else if (literal(r, "false")) {
        value = Py_NewRef(Py_False);
    } else if (literal(r, "null")) {
        value = Py_NewRef(Py_None);
    } else {
        value = give_up(r);
    }
    r->depth--;
    return value;
}

PyDoc_STRVAR(loads_doc,
             "loads(data, numbers, fallback)\n--\n\n"
             "The JSON document in ``data`` (a bytes-like object), or ``fallback`` where the json\n"
             "module must parse it. With ``numbers`` (not None), an array of plain numbers that is\n"
             "the value of a ``data`` key comes back as ``numbers(buffer, kind)``: ``buffer`` a\n"
             "bytearray of int64 (``kind`` 'q') or float64 (``kind`` 'd') values.");

static PyObject *kj_loads(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer view;
    PyObject *numbers, *fallback;
    if (!PyArg_ParseTuple(args, "y*OO", &view, &numbers, &fallback)) {
        return NULL;
    }
    Reader r = {(const char *)view.buf, (const char *)view.buf + view.len, numbers == Py_None ? NULL : numbers,
                0, 0, extended_precision()};
    PyObject *value = read_value(&r, 0);
    if (value != NULL) {
        skip_ws(&r);
        if (r.p != r.end) {
            Py_DECREF(value);
            value = NULL;
            r.fallback = 1;
        }
    }
    PyBuffer_Release(&view);
    if (value == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return NULL; /* an error of ``numbers`` */
        }
        if (!PyErr_Occurred()) {
            return Py_NewRef(fallback);
        }
        return NULL;
    }
    return value;
}

/* The writer's text: a bytes object grown by doubling and cut to its length at the end, so
 * that the text is never copied whole. */
typedef struct {
    PyObject *bytes;
    size_t len;
    size_t cap;
    PyThreadState *save; /* not NULL while the writer runs with the GIL released */
    int fast;            /* the long double fast path may be used (see extended_precision) */
} Text;

static int text_reserve(Text *t, size_t more) {
    if (t->len + more <= t->cap) {
        return 0;
    }
    size_t cap = t->cap ? t->cap : 256;
    while (cap < t->len + more) {
        cap *= 2;
    }
    if (t->save != NULL) {
        PyEval_RestoreThread(t->save);
    }
    int rc = 0;
    if (cap > (size_t)PY_SSIZE_T_MAX) {
        PyErr_NoMemory();
        rc = -1;
    } else if (t->bytes == NULL) {
        t->bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
        rc = t->bytes == NULL ? -1 : 0;
    } else if (_PyBytes_Resize(&t->bytes, (Py_ssize_t)cap) < 0) {
        rc = -1; /* t->bytes is NULL (freed) now */
    }
    if (t->save != NULL) {
        t->save = PyEval_SaveThread();
    }
    if (rc == 0) {
        t->cap = cap;
    }
    return rc;
}

static int text_add(Text *t, const char *s, size_t n) {
    if (text_reserve(t, n) < 0) {
        return -1;
    }
    memcpy(PyBytes_AS_STRING(t->bytes) + t->len, s, n);
    t->len += n;
    return 0;
}

static int write_double(Text *t, double v) {
    if (isnan(v)) {
        return text_add(t, "NaN", 3);
    }
    if (isinf(v)) {
        return v > 0 ? text_add(t, "Infinity", 8) : text_add(t, "-Infinity", 9);
    }
#ifdef HAVE_X87_FAST_PATH
    char fast[40];
    int n = t->fast && v != 0.0 ? fast_repr(v, fast) : -1;
    if (n > 0) {
        return text_add(t, fast, (size_t)n);
    }
#endif
    if (t->save != NULL) {
        PyEval_RestoreThread(t->save);
    }
    char *s = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    char copy[40];
    size_t size = s != NULL ? strlen(s) : 0;
    if (s != NULL && size < sizeof copy) {
        memcpy(copy, s, size);
    }
    int too_long = s != NULL && size >= sizeof copy;
    PyMem_Free(s);
    if (too_long) {
        PyErr_SetString(PyExc_ValueError, "dumps_numbers: a float's text is too long");
    }
    if (t->save != NULL) {
        t->save = PyEval_SaveThread();
    }
    if (s == NULL || too_long) {
        return -1;
    }
    return text_add(t, copy, size);
}

static int write_signed(Text *t, long long v) {
    char s[32];
    int n = snprintf(s, sizeof s, "%lld", v);
    return text_add(t, s, (size_t)n);
}

static int write_unsigned(Text *t, unsigned long long v) {
    char s[32];
    int n = snprintf(s, sizeof s, "%llu", v);
    return text_add(t, s, (size_t)n);
}

/* One element of C type `ctype` at `item`, written by `writer` as `as`. */
#define WRITE_ITEM(ctype, writer, as)      \
    {                                      \
        ctype v;                           \
        memcpy(&v, item, sizeof v);        \
        rc = writer(&t, (as)v);            \
        break;                             \
    }

PyDoc_STRVAR(dumps_doc,
             "dumps_numbers(array)\n--\n\n"
             "``json.dumps(list(array))`` of a flat buffer of numbers or booleans (struct format\n"
             "'?', 'b', 'B', 'h', 'H', 'i', 'I', 'l', 'L', 'q', 'Q', 'f' or 'd'), as bytes.");

static PyObject *kj_dumps_numbers(PyObject *module, PyObject *arg) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    const char *format = view.format ? view.format : "B";
    if (format[0] == '=' || format[0] == '<' || format[0] == '@') {
        format++;
    }
    char kind = format[0];
    if (format[0] == '\0' || format[1] != '\0' || strchr("?bBhHiIlLqQfd", kind) == NULL) {
        PyErr_Format(PyExc_TypeError, "dumps_numbers: unsupported format %s", view.format ? view.format : "B");
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t count = view.itemsize ? view.len / view.itemsize : 0;
    const char *base = view.buf;
    Text t = {NULL, 0, 0, NULL, extended_precision()};
    /* Room for the longest elements at once ("-2.2250738585072014e-308, ", "-9223372036854775808, "),
     * so that the loop, run with the GIL released, does not grow the text. */
    size_t widest = kind == 'f' || kind == 'd' ? 26 : kind == '?' ? 7 : 22;
    int rc = text_reserve(&t, (size_t)count * widest + 2);
    if (rc == 0) {
        rc = text_add(&t, "[", 1);
    }
    t.save = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < count && rc == 0; i++) {
        if (i) {
            rc = text_add(&t, ", ", 2);
            if (rc) {
                break;
            }
        }
        const char *item = base + i * view.itemsize;
        switch (kind) {
            case '?': {
                unsigned char b;
                memcpy(&b, item, 1);
                rc = b ? text_add(&t, "true", 4) : text_add(&t, "false", 5);
                break;
            }
            case 'b': WRITE_ITEM(signed char, write_signed, long long)
            case 'B': WRITE_ITEM(unsigned char, write_unsigned, unsigned long long)
            case 'h': WRITE_ITEM(short, write_signed, long long)
            case 'H': WRITE_ITEM(unsigned short, write_unsigned, unsigned long long)
            case 'i': WRITE_ITEM(int, write_signed, long long)
            case 'I': WRITE_ITEM(unsigned int, write_unsigned, unsigned long long)
            case 'l': WRITE_ITEM(long, write_signed, long long)
            case 'L': WRITE_ITEM(unsigned long, write_unsigned, unsigned long long)
            case 'q': WRITE_ITEM(long long, write_signed, long long)
            case 'Q': WRITE_ITEM(unsigned long long, write_unsigned, unsigned long long)
            case 'f': WRITE_ITEM(float, write_double, double)
            default: WRITE_ITEM(double, write_double, double)
        }
    }
    PyEval_RestoreThread(t.save);
    t.save = NULL;
    PyBuffer_Release(&view);
    if (rc == 0) {
        rc = text_add(&t, "]", 1);
    }
    if (rc == 0 && _PyBytes_Resize(&t.bytes, (Py_ssize_t)t.len) == 0) {
        return t.bytes;
    }
    Py_XDECREF(t.bytes);
    return NULL;
}

static PyMethodDef methods[] = {
    {"loads", kj_loads, METH_VARARGS, loads_doc},
    {"dumps_numbers", kj_dumps_numbers, METH_O, dumps_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kserve_json", "KServe v2 JSON tensors in C.", -1, methods,
    NULL,                  NULL,           NULL,                           NULL,
};

PyMODINIT_FUNC PyInit__kserve_json(void) {
    init_powers();
    return PyModule_Create(&module_def);
}
