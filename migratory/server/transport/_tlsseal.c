/*
 * One TLS 1.3 record sealed (AES-GCM) in one call, and optionally written to a socket in the same call.
 *
 * Why C: at fan-out a wss:// delivery is one record per subscriber, and in Python the seal was about
 * 0.7 us a record (cryptography's AESGCM.encrypt copies its cipher context on every call, then the
 * nonce, the header and a concatenation), half of what TLS added to a delivery (bench/tls.md).
 * Here a connection keeps one initialised EVP_CIPHER_CTX (its key schedule and GCM tables) while it
 * is active; a record is the nonce set on it, the header as additional data, the plaintext, the tag.
 *
 * No OpenSSL header nor link: the eight EVP functions are given to configure() as addresses that
 * migratory/server/transport/tls/sealer.py resolves through the ``_ssl`` extension, so the library is the
 * very libcrypto Python's ssl module runs (the one that made the handshake), and building this
 * module needs only a C compiler and Python's headers. If it is not built, the transport seals in
 * Python with cryptography's AESGCM (same records, slower).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef struct evp_cipher_ctx EVP_CIPHER_CTX; /* opaque, as in OpenSSL's headers */
typedef struct evp_cipher EVP_CIPHER;

static EVP_CIPHER_CTX *(*ctx_new)(void);
static void (*ctx_free)(EVP_CIPHER_CTX *);
static int (*encrypt_init)(EVP_CIPHER_CTX *, const EVP_CIPHER *, void *, const unsigned char *,
                           const unsigned char *);
static int (*encrypt_update)(EVP_CIPHER_CTX *, unsigned char *, int *, const unsigned char *, int);
static int (*encrypt_final)(EVP_CIPHER_CTX *, unsigned char *, int *);
static int (*ctx_ctrl)(EVP_CIPHER_CTX *, int, int, void *);
static const EVP_CIPHER *(*aes_128_gcm)(void);
static const EVP_CIPHER *(*aes_256_gcm)(void);
static int configured;

#define EVP_CTRL_GCM_GET_TAG 0x10 /* OpenSSL 1.1 and 3: EVP_CTRL_AEAD_GET_TAG */
#define TAG 16
#define MAX_INNER ((1 << 14) + 1) /* RFC 8446 5.4: 2^14 bytes of plaintext and the content type */
#define MAX_HEADER 5
#define MAX_RECORD (MAX_HEADER + MAX_INNER + TAG)

typedef struct {
    PyObject_HEAD
    EVP_CIPHER_CTX *ctx; /* key schedule and GCM tables, set once */
    unsigned char iv[12];
} Sealer;

static void Sealer_dealloc(Sealer *self) {
    if (self->ctx != NULL)
        ctx_free(self->ctx);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Sealer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"key", "iv", NULL};
    Py_buffer key, iv;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_tlsseal.configure() was not called");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*y*:Sealer", names, &key, &iv))
        return NULL;
    Sealer *self = NULL;
    const EVP_CIPHER *cipher = key.len == 16 ? aes_128_gcm() : key.len == 32 ? aes_256_gcm() : NULL;
    if (cipher == NULL || iv.len != 12) {
        PyErr_SetString(PyExc_ValueError, "an AES-GCM key is 16 or 32 bytes and its IV 12");
        goto done;
    }
    self = (Sealer *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto done;
    memcpy(self->iv, iv.buf, 12);
    self->ctx = ctx_new();
    if (self->ctx == NULL || encrypt_init(self->ctx, cipher, NULL, (const unsigned char *)key.buf, NULL) != 1) {
        Py_CLEAR(self);
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-GCM");
    }
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&iv);
    return (PyObject *)self;
}

/* header + AES-GCM(inner, aad=header, nonce=iv^seq) + tag into out (len(header)+len(inner)+16 bytes). */
static int seal_into(Sealer *self, unsigned long long seq, const unsigned char *inner, int n,
                     const unsigned char *header, int h, unsigned char *out) {
    unsigned char nonce[12];
    int len = 0, last = 0, aad = 0;
    memcpy(nonce, self->iv, 12);
    for (int i = 0; i < 8; i++)
        nonce[11 - i] ^= (unsigned char)(seq >> (8 * i));
    memcpy(out, header, (size_t)h);
    if (encrypt_init(self->ctx, NULL, NULL, NULL, nonce) != 1 || encrypt_update(self->ctx, NULL, &aad, header, h) != 1 ||
        encrypt_update(self->ctx, out + h, &len, inner, n) != 1 || encrypt_final(self->ctx, out + h + len, &last) != 1 ||
        len + last != n || ctx_ctrl(self->ctx, EVP_CTRL_GCM_GET_TAG, TAG, out + h + n) != 1) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL failed to seal a record");
        return -1;
    }
    return 0;
}

/* The arguments shared by seal() and send(): seq, inner, header, checked. */
static int parse(PyObject *const *args, unsigned long long *seq, const unsigned char **inner, int *n,
                 const unsigned char **header, int *h) {
    if (!PyBytes_CheckExact(args[1]) || !PyBytes_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "inner and header must be bytes");
        return -1;
    }
    *seq = PyLong_AsUnsignedLongLong(args[0]);
    if (*seq == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    Py_ssize_t inner_len = PyBytes_GET_SIZE(args[1]), header_len = PyBytes_GET_SIZE(args[2]);
    if (inner_len < 1 || inner_len > MAX_INNER || header_len < 1 || header_len > MAX_HEADER) {
        PyErr_SetString(PyExc_ValueError, "a record is 1 to 2^14+1 bytes of plaintext under a header of at most 5");
        return -1;
    }
    *inner = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    *n = (int)inner_len;
    *header = (const unsigned char *)PyBytes_AS_STRING(args[2]);
    *h = (int)header_len;
    return 0;
}

static PyObject *Sealer_seal(Sealer *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long seq;
    const unsigned char *inner, *header;
    int n, h;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "seal(seq, inner, header)");
        return NULL;
    }
    if (parse(args, &seq, &inner, &n, &header, &h) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)h + n + TAG);
    if (out == NULL)
        return NULL;
    if (seal_into(self, seq, inner, n, header, h, (unsigned char *)PyBytes_AS_STRING(out)) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *Sealer_send(Sealer *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long seq;
    const unsigned char *inner, *header;
    unsigned char record[MAX_RECORD];
    int n, h, fd;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "send(fd, seq, inner, header)");
        return NULL;
    }
    long fd_long = PyLong_AsLong(args[0]);
    if (fd_long == -1 && PyErr_Occurred())
        return NULL;
    if (fd_long < 0 || fd_long > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    fd = (int)fd_long;
    if (parse(args + 1, &seq, &inner, &n, &header, &h) < 0)
        return NULL;
    Py_ssize_t total = (Py_ssize_t)h + n + TAG;
    if (seal_into(self, seq, inner, n, header, h, record) < 0)
        return NULL;
    ssize_t sent = write(fd, record, (size_t)total);
    if (sent == total)
        Py_RETURN_NONE;
    if (sent < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
        sent = 0;
    }
    return PyBytes_FromStringAndSize((const char *)record + sent, total - sent);
}

static PyMethodDef Sealer_methods[] = {
    {"seal", (PyCFunction)(void (*)(void))Sealer_seal, METH_FASTCALL,
     "seal(seq, inner, header) -> bytes: the record (header, ciphertext, tag) of sequence number seq."},
    {"send", (PyCFunction)(void (*)(void))Sealer_send, METH_FASTCALL,
     "send(fd, seq, inner, header) -> bytes | None: seal, write to fd; what the socket did not take, or None."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SealerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "migratory.server.transport._tlsseal.Sealer",
    .tp_basicsize = sizeof(Sealer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sealer(key, iv): AES-GCM TLS 1.3 records under one traffic key.",
    .tp_new = Sealer_new,
    .tp_dealloc = (destructor)Sealer_dealloc,
    .tp_methods = Sealer_methods,
};

static PyObject *configure(PyObject *Py_UNUSED(module), PyObject *args) {
    unsigned long long a[8];
    if (configured)
        Py_RETURN_NONE; /* the first library stays: Sealers made with it must be freed by it */
    if (!PyArg_ParseTuple(args, "KKKKKKKK:configure", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &a[7]))
        return NULL;
    for (int i = 0; i < 8; i++)
        if (a[i] == 0) {
            PyErr_SetString(PyExc_ValueError, "a null function address");
            return NULL;
        }
    ctx_new = (EVP_CIPHER_CTX * (*)(void))(uintptr_t)a[0];
    ctx_free = (void (*)(EVP_CIPHER_CTX *))(uintptr_t)a[1];
    encrypt_init = (int (*)(EVP_CIPHER_CTX *, const EVP_CIPHER *, void *, const unsigned char *,
                            const unsigned char *))(uintptr_t)a[2];
    encrypt_update = (int (*)(EVP_CIPHER_CTX *, unsigned char *, int *, const unsigned char *, int))(uintptr_t)a[3];
    encrypt_final = (int (*)(EVP_CIPHER_CTX *, unsigned char *, int *))(uintptr_t)a[4];
    ctx_ctrl = (int (*)(EVP_CIPHER_CTX *, int, int, void *))(uintptr_t)a[5];
    aes_128_gcm = (const EVP_CIPHER *(*)(void))(uintptr_t)a[6];
    aes_256_gcm = (const EVP_CIPHER *(*)(void))(uintptr_t)a[7];
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(EVP_CIPHER_CTX_new, EVP_CIPHER_CTX_free, EVP_EncryptInit_ex, EVP_EncryptUpdate, "
     "EVP_EncryptFinal_ex, EVP_CIPHER_CTX_ctrl, EVP_aes_128_gcm, EVP_aes_256_gcm): their addresses, once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "migratory.server.transport._tlsseal",
    .m_doc = "TLS 1.3 AES-GCM records sealed in one call.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__tlsseal(void) {
    if (PyType_Ready(&SealerType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&SealerType);
    if (PyModule_AddObject(module, "Sealer", (PyObject *)&SealerType) < 0) {
        Py_DECREF(&SealerType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
