/* Checked reads: ranges of a file read into memory and summed (crc32c) piece by piece as they arrive.
 *
 * Loaded by bytecp.format.checked_reads, which checks it against the crc32c engine of
 * bytecp.format.checksum before anything uses it; called by the local storage backend's buffered
 * reads (storage/local.py, read_ranges_summed) on the loader's reader threads.
 *
 * Why: a load that checks what it reads (every block of a part of a chunk, every whole chunk) summed
 * each range once the read call returned. A range of megabytes has left the CPU's cache by then,
 * so the checksum read it again from memory (about 8 GB/s here), and with eight reader threads on
 * two cores each range's sum waited for the GIL between the reads. Here one call reads a batch's
 * ranges with the GIL released throughout, in pieces of at most `piece` bytes cut at the checked
 * segments' edges, each piece summed right after its pread while it is still in the cache.
 *
 * read_sums(fd, ranges, segs, out, piece, mapped=False) -> None, or (i, got) when range i ended early
 * (the end of the file) after `got` of its bytes:
 *   ranges  a sequence of (file offset, writable buffer) in file order, not overlapping;
 *   segs    int64 [start0, end0, start1, end1, ...]: file byte spans, in order, not overlapping,
 *           each inside the ranges read (a span may cross from one range into the next adjacent one);
 *   out     uint32, one value a span: the crc32c of the span's bytes;
 *   piece   the largest read (and sum) of a checked span at once;
 *   mapped  copy from a shared read-only mapping of the file instead of pread (below), where the
 *           file can be mapped: no system call a piece, streaming stores, the sum folded into the copy.
 * Bytes outside every span are read, not summed. An OSError (errno) ends the call.
 *
 * copy_summed(boxes, block, out): the same copy between memory the caller holds (a save's staging
 * boxes), each block's crc32c taken in it (see the function).
 *
 * Mapped (the local backend's default): the call maps the file 16 MiB at a time (MAP_WINDOW: the
 * mapped pages count in the process's resident set while mapped) and copies each piece out of the
 * mapping, which is the page cache itself: no system call a piece,
 * streaming stores into the destination (not read into the cache first, as a pread's copy does),
 * and on AVX-512 the crc32c folded into the copy's own registers. Measured here on a warm 1 GiB
 * file, 4 threads: 57-68 ms copied and summed so, 83-99 ms pread alone. What cannot be mapped (not a
 * regular file, past its end, a failed mmap) is read with pread; a copy that faults (the file cut
 * short meanwhile, a device error: SIGBUS) is read again with pread, which reports it as an error.
 *
 * crc32c: SSE4.2's crc32 instruction on three independent streams (its latency is three cycles, its
 * throughput one a cycle), their values joined by tables of the operator that appends zeros to a
 * crc; where the CPU lacks SSE4.2 (or the compiler is not for x86-64), HW is 0 and the module is not
 * used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define BYTECP_READS_ABI 5

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(BYTECP_NO_HW)
#define HAVE_HW 1
#include <nmmintrin.h>
#else
#define HAVE_HW 0
#endif

#define POLY 0x82f63b78u
#define LONG_BYTES 8192
#define SHORT_BYTES 256

static int hw_ok = 0;   /* the crc32 instruction (SSE4.2) */
static int wide_ok = 0; /* and VPCLMULQDQ on 512-bit registers (AVX-512) */

static uint32_t zeros_long[4][256];
static uint32_t zeros_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1)
            sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++)
        square[n] = gf2_times(mat, mat[n]);
}

/* the operator that appends one zero byte to a crc: the one-bit operator squared three times */
static void zero_byte_op(uint32_t *op) {
    uint32_t odd[32], even[32];
    odd[0] = POLY;
    uint32_t row = 1;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    gf2_square(op, odd);   /* eight */
}

/* the operators appending 2^k zero bytes to a crc, k = 0..63 (made once, at the module's init: the
 * one-byte operator squared k times) */
static uint32_t pow2_zeros[64][32];

static void pow2_zeros_init(void) {
    zero_byte_op(pow2_zeros[0]);
    for (int k = 1; k < 64; k++)
        gf2_square(pow2_zeros[k], pow2_zeros[k - 1]);
}

/* crc followed by `len` zero bytes (any len >= 0): zlib's crc32_combine, one made operator applied for
 * each bit of len (a few hundred operations a bit, nothing squared per call) */
static uint32_t append_zeros(uint32_t crc, unsigned long long len) {
    for (int k = 0; len; k++, len >>= 1)
        if (len & 1)
            crc = gf2_times(pow2_zeros[k], crc);
    return crc;
}

/* the operator appending `len` zero bytes to a crc (any len >= 0), as a matrix: each column the
 * column of the identity with `len` zero bytes appended */
static void zeros_any(uint32_t *op, unsigned long long len) {
    for (int n = 0; n < 32; n++)
        op[n] = append_zeros((uint32_t)1 << n, len);
}

/* an operator's matrix as four tables of 256, one a byte of the crc (applied by shift) */
static void op_tables(uint32_t zeros[][256], const uint32_t *op) {
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static void zeros_tables(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_any(op, len);
    op_tables(zeros, op);
}

static inline uint32_t shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

#if HAVE_HW
static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* the last bytes, eight at a time then one by one (the running value, not inverted) */
__attribute__((target("sse4.2"))) static inline uint64_t the_rest(uint64_t crc, const unsigned char *p, size_t len) {
    while (len >= 8) {
        crc = _mm_crc32_u64(crc, load64(p));
        p += 8;
        len -= 8;
    }
    while (len) {
        crc = _mm_crc32_u8((uint32_t)crc, *p++);
        len--;
    }
    return crc;
}

/* the whole runs of 3 * span bytes at *next: three streams of span bytes summed at once, then joined */
__attribute__((target("sse4.2"))) static inline uint64_t three_streams(uint64_t crc0, const unsigned char **at,
                                                                       size_t *left, size_t span,
                                                                       uint32_t zeros[][256]) {
    const unsigned char *next = *at;
    size_t len = *left;
    while (len >= span * 3) {
        uint64_t crc1 = 0, crc2 = 0;
        const unsigned char *end = next + span;
        do {
            crc0 = _mm_crc32_u64(crc0, load64(next));
            crc1 = _mm_crc32_u64(crc1, load64(next + span));
            crc2 = _mm_crc32_u64(crc2, load64(next + 2 * span));
            next += 8;
        } while (next < end);
        crc0 = shift(zeros, (uint32_t)crc0) ^ crc1;
        crc0 = shift(zeros, (uint32_t)crc0) ^ crc2;
        next += 2 * span;
        len -= 3 * span;
    }
    *at = next;
    *left = len;
    return crc0;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const unsigned char *next, size_t len) {
    uint64_t crc0 = crc ^ 0xffffffffu;
    while (len && ((uintptr_t)next & 7) != 0) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    crc0 = three_streams(crc0, &next, &len, LONG_BYTES, zeros_long);
    crc0 = three_streams(crc0, &next, &len, SHORT_BYTES, zeros_short);
    return (uint32_t)the_rest(crc0, next, len) ^ 0xffffffffu;
}

/* The same sum 64 bytes a step on four 512-bit registers (AVX-512 VPCLMULQDQ), where the CPU has it:
 * each 128-bit lane of data A, `d` bits before the end of later data B, is folded into B as
 * H(A) * (x^(d+63) mod P) * x + L(A) * (x^(d-1) mod P) * x (H, L: its first and last eight bytes; the
 * products' one-bit shift is the reflected carry-less product's), which leaves the sum unchanged. The
 * last 128 bits then go through the crc32 instruction. About 2.5 times the three streams' speed. */
#include <immintrin.h>

static __m128i k128, k256, k384, k512, k2048;

static uint32_t xpow_mod(unsigned n) { /* x^n mod P, not reflected */
    uint32_t v = 1;
    while (n--)
        v = (v << 1) ^ ((v & 0x80000000u) ? 0x1EDC6F41u : 0);
    return v;
}

static uint64_t reflected(uint32_t v) { /* the degree-d coefficient at bit 63 - d */
    uint64_t r = 0;
    for (int d = 0; d < 32; d++)
        if ((v >> d) & 1)
            r |= (uint64_t)1 << (63 - d);
    return r;
}

__attribute__((target("sse2"))) static __m128i fold_constants(unsigned d) {
    return _mm_set_epi64x((long long)reflected(xpow_mod(d - 1)), (long long)reflected(xpow_mod(d + 63)));
}

__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i fold512(__m512i a, __m512i k, __m512i b) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11), b,
                                     0x96);
}

__attribute__((target("sse2,pclmul"))) static inline __m128i fold128(__m128i a, __m128i k, __m128i b) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11)), b);
}

/* the four lanes' sums folded into one, then the len (< 256) bytes left at p folded in: the crc32c */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) static inline uint32_t fold_rest(
    __m512i x0, __m512i x1, __m512i x2, __m512i x3, const unsigned char *p, size_t len) {
    __m512i k = _mm512_broadcast_i32x4(k512);
    x1 = fold512(x0, k, x1);
    x2 = fold512(x1, k, x2);
    x3 = fold512(x2, k, x3);
    while (len >= 64) {
        x3 = fold512(x3, k, _mm512_loadu_si512((const void *)p));
        p += 64;
        len -= 64;
    }
    __m128i r = fold128(_mm512_extracti32x4_epi32(x3, 0), k384, _mm512_extracti32x4_epi32(x3, 3));
    r = _mm_xor_si128(r, fold128(_mm512_extracti32x4_epi32(x3, 1), k256, _mm_setzero_si128()));
    r = _mm_xor_si128(r, fold128(_mm512_extracti32x4_epi32(x3, 2), k128, _mm_setzero_si128()));
    while (len >= 16) {
        r = fold128(r, k128, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(r, 1));
    return (uint32_t)the_rest(c, p, len) ^ 0xffffffffu;
}

/* len >= 256 */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) static uint32_t crc32c_wide(uint32_t crc,
                                                                                          const unsigned char *p,
                                                                                          size_t len) {
    __m512i x0 = _mm512_loadu_si512((const void *)p), x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128)), x3 = _mm512_loadu_si512((const void *)(p + 192));
    x0 = _mm512_xor_si512(x0, _mm512_castsi128_si512(_mm_cvtsi32_si128((int)(crc ^ 0xffffffffu))));
    p += 256;
    len -= 256;
    __m512i k = _mm512_broadcast_i32x4(k2048);
    while (len >= 256) {
        x0 = fold512(x0, k, _mm512_loadu_si512((const void *)p));
        x1 = fold512(x1, k, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = fold512(x2, k, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = fold512(x3, k, _mm512_loadu_si512((const void *)(p + 192)));
        p += 256;
        len -= 256;
    }
    return fold_rest(x0, x1, x2, x3, p, len);
}

static uint32_t crc32c_any(uint32_t crc, const unsigned char *p, size_t len, int wide) {
    if (wide && wide_ok && len >= 256)
        return crc32c_wide(crc, p, len);
    return crc32c_hw(crc, p, len);
}

/* Copies from a mapping of the page cache, summed on the way: the stores are streaming (non-temporal)
 * ones, which write the destination without reading it into the cache first (a third of the memory
 * traffic of a copy into memory not in the cache, as a pread's is); on AVX-512 the crc32c folds the
 * very registers the copy loaded, so the sum costs no read of its own (measured here on 1 GiB with 4
 * threads: 57-68 ms a copy summed this way, 61-70 not summed, 83-99 a pread, 94-114 a pread summed). */

/* 256 bytes at p loaded into v[0..3] and streamed to d (64-byte aligned) */
__attribute__((target("avx512f"))) static inline void stream256(unsigned char *d, const unsigned char *p, __m512i *v) {
    for (int i = 0; i < 4; i++) {
        v[i] = _mm512_loadu_si512((const void *)(p + 64 * i));
        _mm512_stream_si512((void *)(d + 64 * i), v[i]);
    }
}

/* len a multiple of 256 (>= 256), d 64-byte aligned: d = p's bytes, the crc32c continued over them */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) static uint32_t copy_sum_wide(uint32_t crc,
                                                                                            unsigned char *d,
                                                                                            const unsigned char *p,
                                                                                            size_t len) {
    __m512i v[4];
    stream256(d, p, v);
    __m512i x0 = _mm512_xor_si512(v[0], _mm512_castsi128_si512(_mm_cvtsi32_si128((int)(crc ^ 0xffffffffu))));
    __m512i x1 = v[1], x2 = v[2], x3 = v[3];
    p += 256;
    d += 256;
    len -= 256;
    __m512i k = _mm512_broadcast_i32x4(k2048);
    while (len >= 256) {
        stream256(d, p, v);
        x0 = fold512(x0, k, v[0]);
        x1 = fold512(x1, k, v[1]);
        x2 = fold512(x2, k, v[2]);
        x3 = fold512(x3, k, v[3]);
        p += 256;
        d += 256;
        len -= 256;
    }
    return fold_rest(x0, x1, x2, x3, p, 0);
}

/* len a multiple of 64, d 64-byte aligned: a streaming copy (SSE2, every x86-64 CPU) */
__attribute__((target("sse2"))) static void stream_copy(unsigned char *d, const unsigned char *p, size_t len) {
    while (len >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(p + 32)), e = _mm_loadu_si128((const __m128i *)(p + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        p += 64;
        d += 64;
        len -= 64;
    }
}

/* len a multiple of 256, d 64-byte aligned: the same copy 256 bytes a step on 512-bit registers (AVX-512) */
__attribute__((target("avx512f"))) static void stream_copy_wide(unsigned char *d, const unsigned char *p, size_t len) {
    __m512i v[4];
    for (; len >= 256; len -= 256, p += 256, d += 256)
        stream256(d, p, v);
}

/* copies below this are plain ones (their destination is likely read soon, from the cache) */
#define STREAM_BYTES (64 << 10)
/* without AVX-512, a streamed copy is summed from its source this many bytes at a time (in the cache) */
#define STREAM_PIECE (64 << 10)
/* the most of a file a mapped read maps at once (read_sums) */
#define MAP_WINDOW (16 << 20)

/* d = p's len bytes; the crc32c continued over them when sum, else crc unchanged */
/* wide: the AVX-512 path where the CPU has it (0: the SSE2 stream and SSE4.2 crc32c, for tests) */
__attribute__((target("sse2,sse4.2"))) static uint32_t copy_sum_any(uint32_t crc, unsigned char *d,
                                                                   const unsigned char *p, size_t len, int sum,
                                                                   int wide) {
    wide = wide && wide_ok;
    if (len < STREAM_BYTES) {
        memcpy(d, p, len);
        return sum ? crc32c_any(crc, d, len, wide) : crc;
    }
    size_t head = (size_t)(-(uintptr_t)d) & 63;
    memcpy(d, p, head);
    if (sum)
        crc = crc32c_hw(crc, p, head);
    d += head;
    p += head;
    len -= head;
    size_t body = len & ~(size_t)255;
    if (sum && wide) {
        crc = copy_sum_wide(crc, d, p, body);
    } else if (wide) {
        stream_copy_wide(d, p, body);
    } else {
        for (size_t at = 0; at < body; at += STREAM_PIECE) {
            size_t n = body - at < STREAM_PIECE ? body - at : STREAM_PIECE;
            stream_copy(d + at, p + at, n);
            if (sum)
                crc = crc32c_hw(crc, p + at, n);
        }
    }
    _mm_sfence(); /* the streamed stores seen before what follows (another thread reads the tensor) */
    memcpy(d + body, p + body, len - body);
    return sum ? crc32c_hw(crc, p + body, len - body) : crc;
}

static inline uint32_t copy_sum(uint32_t crc, unsigned char *d, const unsigned char *p, size_t len, int sum) {
    return copy_sum_any(crc, d, p, len, sum, 1);
}

/* A mapped file can fault where a pread fails: a file cut short after the mapping was made, or a
 * device's read error, is a SIGBUS at the copy. A copy from a mapping runs under a guard: this
 * thread's jump back into mapped_copy, taken by the handler below, after which the piece is read
 * again with pread (which reports the end of the file or the error as a pread would). The handler
 * is installed over SIGBUS's (Python's faulthandler's, the default) at a mapped read, puts that one
 * back for any fault not of a guarded copy (which then takes it as if this one had never been), and
 * is put back on top at the next mapped read if another was installed since. */
static __thread sigjmp_buf *bus_guard __attribute__((tls_model("initial-exec")));
static struct sigaction bus_before;
static pthread_mutex_t bus_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned long bus_caught = 0; /* faults of guarded copies, for tests and diagnostics */
static unsigned long long mapped_copied = 0; /* bytes copied out of a mapping, for tests and diagnostics */

static void on_bus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *guard = bus_guard;
    if (guard != NULL && info != NULL && info->si_code > 0) { /* a fault (not a signal sent) in a guarded copy */
        bus_guard = NULL;
        __atomic_fetch_add(&bus_caught, 1, __ATOMIC_RELAXED);
        siglongjmp(*guard, 1);
    }
    /* not a guarded copy's: as if this handler were never installed. A fault comes again on return,
     * to the handler before this one (the default: fatal); a SIGBUS sent by a process is sent again */
    sigaction(SIGBUS, &bus_before, NULL);
    if (info == NULL || info->si_code <= 0)
        raise(sig);
    (void)ctx;
}

static int is_ours(const struct sigaction *a) {
    return (a->sa_flags & SA_SIGINFO) && a->sa_sigaction == on_bus;
}

/* 1 when a guarded copy can run (the handler is SIGBUS's), 0 when it cannot be installed */
static int bus_handled(void) {
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return 0;
    if (is_ours(&now))
        return 1;
    int ok = 0;
    pthread_mutex_lock(&bus_lock);
    if (sigaction(SIGBUS, NULL, &now) == 0) {
        if (is_ours(&now)) {
            ok = 1;
        } else {
            struct sigaction ours;
            memset(&ours, 0, sizeof ours);
            ours.sa_sigaction = on_bus;
            ours.sa_flags = SA_SIGINFO | SA_NODEFER; /* not blocked after the jump out of it */
            sigemptyset(&ours.sa_mask);
            bus_before = now;
            ok = sigaction(SIGBUS, &ours, NULL) == 0;
        }
    }
    pthread_mutex_unlock(&bus_lock);
    return ok;
}

/* copy_sum from a mapping, under the guard: 0, or -1 when the mapping faulted (nothing of *crc changed) */
static int mapped_copy(unsigned char *d, const unsigned char *p, size_t len, uint32_t *crc, int sum) {
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0))
        return -1;
    bus_guard = &jump;
    uint32_t value = copy_sum(*crc, d, p, len, sum);
    bus_guard = NULL;
    *crc = value;
    return 0;
}
#endif

/* crc32c(data, value=0): the module's own sum (for the self-check and tests) */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned long long value = 0;
    int wide = 1;
    if (!PyArg_ParseTuple(args, "y*|Kp", &b, &value, &wide))
        return NULL;
    if (!hw_ok) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no SSE4.2 crc32 instruction");
        return NULL;
    }
    uint32_t crc = 0;
#if HAVE_HW
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c_any((uint32_t)value, (const unsigned char *)b.buf, (size_t)b.len, wide);
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(crc);
}

/* mapped_faults(): how many copies from a mapping faulted in this process (and were read again) */
static PyObject *py_mapped_faults(PyObject *self, PyObject *unused) {
    unsigned long n = 0;
#if HAVE_HW
    n = __atomic_load_n(&bus_caught, __ATOMIC_RELAXED);
#endif
    return PyLong_FromUnsignedLong(n);
}

/* mapped_bytes(): how many bytes read_sums copied out of a mapping in this process (a read the
 * mapping could not serve is a pread, not counted): what proves a mapped read maps */
static PyObject *py_mapped_bytes(PyObject *self, PyObject *unused) {
    unsigned long long n = 0;
#if HAVE_HW
    n = __atomic_load_n(&mapped_copied, __ATOMIC_RELAXED);
#endif
    return PyLong_FromUnsignedLongLong(n);
}

/* copy_sum(dst, src, value=0, sum=True, wide=True): dst[:] = src (the mapped reads' copy), the crc32c of
 * src continued from value when sum; wide=False takes the path of CPUs without AVX-512 (for the
 * self-check and tests) */
static PyObject *py_copy_sum(PyObject *self, PyObject *args) {
    Py_buffer d, b;
    unsigned long long value = 0;
    int sum = 1, wide = 1;
    if (!PyArg_ParseTuple(args, "w*y*|Kpp", &d, &b, &value, &sum, &wide))
        return NULL;
    PyObject *result = NULL;
    if (!hw_ok) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no SSE4.2 crc32 instruction");
    } else if (d.len != b.len) {
        PyErr_SetString(PyExc_ValueError, "copy_sum: dst and src differ in length");
    } else {
        uint32_t crc = (uint32_t)value;
#if HAVE_HW
        Py_BEGIN_ALLOW_THREADS
        crc = copy_sum_any(crc, (unsigned char *)d.buf, (const unsigned char *)b.buf, (size_t)b.len, sum, wide);
        Py_END_ALLOW_THREADS
#endif
        result = PyLong_FromUnsignedLong(crc);
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&b);
    return result;
}

/* crc_of_blocks(blocks, block, nbytes): the crc32c of nbytes bytes from the crc32c of each of their
 * blocks of `block` bytes in order (uint32, the last one shorter): crc32c_combine block after block,
 * from the operators made at init (a few microseconds for tens of blocks; past 256 blocks, tables of
 * the block's operator), for a lazy save's copies (bytecp.saving.hostcopy) */
static PyObject *py_crc_of_blocks(PyObject *self, PyObject *args) {
    Py_buffer b;
    long long block, nbytes;
    if (!PyArg_ParseTuple(args, "y*LL", &b, &block, &nbytes))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = b.len / 4;
    if (b.len % 4 || ((uintptr_t)b.buf % 4) || block <= 0 || nbytes < 0 || m != (nbytes ? (nbytes + block - 1) / block : 1)) {
        PyErr_SetString(PyExc_ValueError, "crc_of_blocks: one aligned uint32 a block of nbytes, block > 0");
    } else {
        const uint32_t *c = (const uint32_t *)b.buf;
        uint32_t crc = c[0];
        if (m > 1) {
            if (m > 256) { /* tables: a few lookups a block instead of a product a bit of the block size */
                uint32_t whole[32], tables[4][256];
                zeros_any(whole, (unsigned long long)block);
                op_tables(tables, whole);
                for (Py_ssize_t i = 1; i < m - 1; i++)
                    crc = shift(tables, crc) ^ c[i];
            } else {
                for (Py_ssize_t i = 1; i < m - 1; i++)
                    crc = append_zeros(crc, (unsigned long long)block) ^ c[i];
            }
            crc = append_zeros(crc, (unsigned long long)(nbytes - (long long)(m - 1) * block)) ^ c[m - 1];
        }
        result = PyLong_FromUnsignedLong(crc);
    }
    PyBuffer_Release(&b);
    return result;
}

/* copy_summed(boxes, block, out): copies between memory the caller holds, summed block by block (the
 * staging copies of a save, bytecp.saving.hostcopy): boxes int64 [dst address, src address, n, ...];
 * out uint32, for each box in order one value a block of `block` bytes (the last one shorter; one
 * value for an empty box): the crc32c of that block of the copied bytes -- or empty: copied, not
 * summed. The GIL is released for the whole call; each block is copy_sum's (streaming stores from
 * 64 KiB, summed in the copy). */
static PyObject *py_copy_summed(PyObject *self, PyObject *args) {
    Py_buffer boxes, out;
    long long block;
    if (!PyArg_ParseTuple(args, "y*Lw*", &boxes, &block, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = boxes.len / 24, want = 0;
    const long long *bx = (const long long *)boxes.buf;
    if (!hw_ok) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no SSE4.2 crc32 instruction");
        goto done;
    }
    if (boxes.len % 24 || block <= 0 || ((uintptr_t)boxes.buf % 8) || ((uintptr_t)out.buf % 4)) {
        PyErr_SetString(PyExc_ValueError, "copy_summed: boxes must be aligned int64 triples, block > 0, out aligned uint32");
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (bx[3 * i + 2] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_summed: a box of negative length");
            goto done;
        }
        want += bx[3 * i + 2] ? (Py_ssize_t)((bx[3 * i + 2] + block - 1) / block) : 1;
    }
    int sum = out.len != 0;
    if (sum && out.len != want * 4) {
        PyErr_SetString(PyExc_ValueError, "copy_summed: out must hold one uint32 a block of every box, or none");
        goto done;
    }
#if HAVE_HW
    uint32_t *crcs = (uint32_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        unsigned char *d = (unsigned char *)(uintptr_t)bx[3 * i];
        const unsigned char *p = (const unsigned char *)(uintptr_t)bx[3 * i + 1];
        long long n = bx[3 * i + 2];
        if (!sum) {
            copy_sum(0, d, p, (size_t)n, 0);
            continue;
        }
        if (n == 0)
            crcs[j++] = 0;
        for (long long at = 0; at < n; at += block) {
            size_t k = (size_t)(n - at < block ? n - at : block);
            crcs[j++] = copy_sum(0, d + at, p + at, k, 1);
        }
    }
    Py_END_ALLOW_THREADS
#endif
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&boxes);
    PyBuffer_Release(&out);
    return result;
}

typedef struct {
    long long offset;
    Py_ssize_t len;
    unsigned char *buf;
} Range;

/* fill n bytes at p from the file's offset: 0, 1 at the end of the file (*got set), -1 errno */
static int pread_full(int fd, unsigned char *p, size_t n, long long offset, size_t *got) {
    size_t done = 0;
    while (done < n) {
        size_t want = n - done;
        if (want > ((size_t)1 << 30))
            want = (size_t)1 << 30;
        ssize_t r = pread(fd, p + done, want, (off_t)(offset + (long long)done));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            *got = done;
            return -1;
        }
        if (r == 0) {
            *got = done;
            return 1;
        }
        done += (size_t)r;
    }
    *got = done;
    return 0;
}

static PyObject *read_sums(PyObject *self, PyObject *args) {
    int fd;
    PyObject *ranges_obj;
    Py_buffer segs, out;
    long long piece;
    int mapped = 0;
    if (!PyArg_ParseTuple(args, "iOy*w*L|p", &fd, &ranges_obj, &segs, &out, &piece, &mapped))
        return NULL;
    PyObject *result = NULL, *seq = NULL;
    Py_buffer *views = NULL;
    Range *rs = NULL;
    Py_ssize_t nr = 0, held = 0;
    Py_ssize_t m = segs.len / 16;
    if (!hw_ok) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no SSE4.2 crc32 instruction");
        goto done;
    }
    if (segs.len % 16 || out.len != m * 4 || piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "read_sums: segs must be int64 pairs, out one uint32 a pair, piece > 0");
        goto done;
    }
    if (piece > ((long long)1 << 30))
        piece = (long long)1 << 30;
    if (((uintptr_t)segs.buf % 8) || ((uintptr_t)out.buf % 4)) {
        PyErr_SetString(PyExc_ValueError, "read_sums: segs must be 8-byte aligned, out 4-byte aligned");
        goto done;
    }
    /* a tuple of its own: converting an offset runs Python (__index__) that could change a list */
    seq = PySequence_Tuple(ranges_obj);
    if (seq == NULL)
        goto done;
    nr = PyTuple_GET_SIZE(seq);
    views = PyMem_Calloc((size_t)(nr ? nr : 1), sizeof(Py_buffer));
    rs = PyMem_Calloc((size_t)(nr ? nr : 1), sizeof(Range));
    if (views == NULL || rs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    long long prev_end = -1;
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        PyObject *off_obj, *buf_obj;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "read_sums: each range must be (offset, buffer)");
            goto done;
        }
        off_obj = PyTuple_GET_ITEM(item, 0);
        buf_obj = PyTuple_GET_ITEM(item, 1);
        long long off = PyLong_AsLongLong(off_obj);
        if (off == -1 && PyErr_Occurred())
            goto done;
        if (PyObject_GetBuffer(buf_obj, &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held = i + 1;
        if (off < 0 || off < prev_end || views[i].len > LLONG_MAX - off) {
            PyErr_SetString(PyExc_ValueError, "read_sums: ranges must be in file order, not overlapping");
            goto done;
        }
        rs[i].offset = off;
        rs[i].len = views[i].len;
        rs[i].buf = views[i].buf;
        prev_end = off + views[i].len;
    }
    const long long *sp = (const long long *)segs.buf;
    for (Py_ssize_t k = 0; k < m; k++) {
        if (sp[2 * k] > sp[2 * k + 1] || (k && sp[2 * k] < sp[2 * k - 1])) {
            PyErr_SetString(PyExc_ValueError, "read_sums: spans must be in order, not overlapping");
            goto done;
        }
    }
    uint32_t *crcs = (uint32_t *)out.buf;
    memset(crcs, 0, (size_t)m * 4);
    int status = 0, err = 0;
    Py_ssize_t bad = -1;
    size_t bad_got = 0;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_HW
    /* the file mapped a window at a time (to its end at most), where asked and possible: a window of
     * MAP_WINDOW bytes at most, so the page cache's pages a read has mapped (which count in the
     * process's resident set while mapped) stay a few MiB a reader thread */
    const unsigned char *map = NULL;
    long long map_lo = 0, map_hi = 0, file_end = -1;
    long page = sysconf(_SC_PAGESIZE);
    if (mapped && nr > 0 && page > 0 && bus_handled()) {
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
            file_end = (long long)st.st_size;
    }
#endif
    Py_ssize_t si = 0;
    for (Py_ssize_t i = 0; i < nr && status == 0; i++) {
        long long pos = rs[i].offset, end = rs[i].offset + rs[i].len;
        while (pos < end) {
            while (si < m && sp[2 * si + 1] <= pos)
                si++;
            long long stop = end;
            int summed = 0;
            if (si < m && sp[2 * si] < end) {
                if (sp[2 * si] > pos) {
                    stop = sp[2 * si];
                } else {
                    summed = 1;
                    if (sp[2 * si + 1] < stop)
                        stop = sp[2 * si + 1];
                    if (stop - pos > piece) /* (not pos + piece: it may pass LLONG_MAX) */
                        stop = pos + piece;
                }
            }
            unsigned char *p = rs[i].buf + (pos - rs[i].offset);
#if HAVE_HW
            uint32_t unused = 0;
            if (file_end >= 0 && stop <= file_end && (map == NULL || pos < map_lo || stop > map_hi)) {
                if (map != NULL)
                    munmap((void *)map, (size_t)(map_hi - map_lo));
                map = NULL;
                map_lo = pos - pos % page;
                map_hi = map_lo + MAP_WINDOW < file_end ? map_lo + MAP_WINDOW : file_end;
                void *at = mmap(NULL, (size_t)(map_hi - map_lo), PROT_READ, MAP_SHARED, fd, (off_t)map_lo);
                if (at == MAP_FAILED)
                    file_end = -1; /* not mappable: pread from here on */
                else
                    map = (const unsigned char *)at;
                if (stop > map_hi) /* (a piece longer than a window: the rest in the next one) */
                    stop = map_hi;
            }
            if (map != NULL && pos >= map_lo && stop <= map_hi &&
                mapped_copy(p, map + (pos - map_lo), (size_t)(stop - pos), summed ? &crcs[si] : &unused, summed) == 0) {
                __atomic_fetch_add(&mapped_copied, (unsigned long long)(stop - pos), __ATOMIC_RELAXED);
                pos = stop;
                continue;
            }
#endif
            size_t got = 0;
            status = pread_full(fd, p, (size_t)(stop - pos), pos, &got);
            if (status != 0) {
                err = errno;
                bad = i;
                bad_got = (size_t)(pos - rs[i].offset) + got;
                break;
            }
            (void)summed;
#if HAVE_HW
            if (summed)
                crcs[si] = crc32c_any(crcs[si], p, (size_t)(stop - pos), 1);
#endif
            pos = stop;
        }
    }
#if HAVE_HW
    if (map != NULL)
        munmap((void *)map, (size_t)(map_hi - map_lo));
#endif
    Py_END_ALLOW_THREADS
    if (status < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (status > 0)
        result = Py_BuildValue("(nn)", bad, (Py_ssize_t)bad_got);
    else
        result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(rs);
    Py_XDECREF(seq);
    PyBuffer_Release(&segs);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, value=0): the crc32c of a bytes-like object, continued."},
    {"copy_sum", py_copy_sum, METH_VARARGS, "copy_sum(dst, src, value=0, sum=True, wide=True): the mapped reads' copy, summed."},
    {"mapped_faults", py_mapped_faults, METH_NOARGS, "mapped_faults(): copies from a mapping that faulted and were read again."},
    {"mapped_bytes", py_mapped_bytes, METH_NOARGS, "mapped_bytes(): bytes read_sums copied out of a mapping."},
    {"crc_of_blocks", py_crc_of_blocks, METH_VARARGS, "crc_of_blocks(blocks, block, nbytes): a crc32c from its blocks'."},
    {"copy_summed", py_copy_summed, METH_VARARGS, "copy_summed(boxes, block, out): copies summed block by block (see the file)."},
    {"read_sums", read_sums, METH_VARARGS, "Ranges of a file read, their checked spans summed piece by piece (see the file)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "bytecp.format._reads", "Checked reads of local files (bytecp.format.checked_reads).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__reads(void) {
#if HAVE_HW
    __builtin_cpu_init();
    hw_ok = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    wide_ok = hw_ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
              __builtin_cpu_supports("pclmul");
    if (wide_ok) {
        k128 = fold_constants(128);
        k256 = fold_constants(256);
        k384 = fold_constants(384);
        k512 = fold_constants(512);
        k2048 = fold_constants(2048);
    }
#endif
    pow2_zeros_init();
    zeros_tables(zeros_long, LONG_BYTES);
    zeros_tables(zeros_short, SHORT_BYTES);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI", BYTECP_READS_ABI) < 0 || PyModule_AddIntConstant(m, "HW", hw_ok) < 0 ||
        PyModule_AddIntConstant(m, "WIDE", wide_ok) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
