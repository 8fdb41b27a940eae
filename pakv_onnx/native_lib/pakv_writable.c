/* Can the bytes a write op is about to write be written? Asked of the kernel, so a read-only or unmapped
 * page is an answer, never a signal, and no byte's value changes:
 * - one or two probes (a decode step: one page per cache): each byte's aligned 32-bit word gets an atomic add
 *   of 0 from futex(2)'s FUTEX_WAKE_OP (the kernel's own atomic read-modify-write of user memory, which needs
 *   the page writable: EFAULT where it is not; nothing waits on the private futex word it wakes, this
 *   library's own). An atomic add of 0 leaves every byte of the word as it is, even one another thread writes
 *   meanwhile. One system call per probe.
 * - more probes (or a kernel that refuses that futex call with anything but EFAULT): the probed bytes are
 *   copied into a pipe this library keeps (writev(2): EFAULT where a byte cannot be read) and read back onto
 *   themselves (readv(2): EFAULT where it cannot be written). Each byte keeps its value; only bytes the caller
 *   writes itself next are probed, so no other writer's byte is ever put back. Two system calls in all.
 * - where the pipe cannot say (no pipe: a process out of file descriptors), the futex probe, one call per
 *   byte, whatever their number. Only where neither can say does the write go ahead unasked.
 * No ORT, no Python.
 *
 * Cost (the 2-core VM, 2026-12-04, load ~3.5): two probes 0.8 us by futex against 1.0-1.2 us by the pipe
 * (process_vm_writev(2) on this process, an earlier route, took 3.6 us plus a getpid(2)); a write call probes
 * at most four bytes: the lowest and the highest byte it writes in each cache (one, when both are in one
 * page). A cache whose protection changes between those two (an mprotect of part of a pool) is not seen; a
 * whole read-only or unmapped pool always is. The pipe is created on first use (close-on-exec), used under a
 * lock (its bytes are the probes' own), and a forked child makes its own. */
#define _GNU_SOURCE
#include "pakv_core.h"

#include <errno.h>
#include <stdint.h>

#if defined(__linux__)
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>
#endif

#define PAKV_PROBES_PER_CALL 64
/* Up to this many probes go one futex call each; more go through the pipe's two calls. */
#define PAKV_FUTEX_PROBES 2

#if defined(__linux__)
static pthread_mutex_t g_probe_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_probe_once = PTHREAD_ONCE_INIT;
static int g_probe_pipe[2] = {-1, -1};

static void lock_probe(void) { pthread_mutex_lock(&g_probe_lock); }
static void unlock_probe(void) { pthread_mutex_unlock(&g_probe_lock); }
/* A forked child shares the parent's pipe: it drops its copy (and makes its own on first use). */
static void forget_probe_pipe(void) {
  if (g_probe_pipe[0] >= 0) close(g_probe_pipe[0]), close(g_probe_pipe[1]);
  g_probe_pipe[0] = g_probe_pipe[1] = -1;
  unlock_probe();
}
static void register_fork_handlers(void) { pthread_atfork(lock_probe, unlock_probe, forget_probe_pipe); }

/* Empties the pipe of what a probe that failed half-way left there (FIONREAD says how much: a blocking read
 * of more would never return). */
static void drain(int fd) {
  char sink[PAKV_PROBES_PER_CALL];
  int left = 0;
  while (ioctl(fd, FIONREAD, &left) == 0 && left > 0)
    if (read(fd, sink, left < (int)sizeof(sink) ? (size_t)left : sizeof(sink)) <= 0) return;
}

/* One byte into the pipe and back onto itself: 1 writable, 0 not (EFAULT), -1 the kernel would not say. */
static int probe_one(void* addr) {
  struct iovec iov = {addr, 1};
  ssize_t out = writev(g_probe_pipe[1], &iov, 1), back = out == 1 ? readv(g_probe_pipe[0], &iov, 1) : -1;
  if (back == 1) return 1;
  int fault = errno == EFAULT;
  drain(g_probe_pipe[0]);
  return fault ? 0 : -1;
}

/* The first of addrs[0..k) (k <= PAKV_PROBES_PER_CALL) whose byte cannot be written (k: all can), or -1 when
 * the kernel would not say. Called under g_probe_lock with the pipe open. All k bytes go in one writev and
 * come back in one readv; a pipe call that meets an unreadable or unwritable byte fails whole (EFAULT, not a
 * count: it does not say which byte), so then they are asked again one at a time, in order. */
static int64_t probe_batch(void* const* addrs, int k) {
  struct iovec iov[PAKV_PROBES_PER_CALL] = {{0}}; /* all set below; zeroed for GCC -O1's maybe-uninitialized */
  for (int i = 0; i < k; i++) iov[i] = (struct iovec){addrs[i], 1};
  ssize_t out = writev(g_probe_pipe[1], iov, k); /* each byte read: an unreadable one cannot be written either */
  if (out == k && readv(g_probe_pipe[0], iov, k) == k) return k; /* each byte put back onto itself */
  drain(g_probe_pipe[0]);
  for (int i = 0; i < k; i++) {
    int writable = probe_one(addrs[i]);
    if (writable <= 0) return writable < 0 ? -1 : i;
  }
  return k;
}

/* 1: the 32-bit word holding byte `addr` took an atomic add of 0 (writable); 0: EFAULT (not writable);
 * -1: the kernel said something else (ask the pipe). */
static int futex_probe(void* addr) {
  static uint32_t woken; /* the futex word FUTEX_WAKE_OP wakes: nothing ever waits on it */
  uint32_t* word = (uint32_t*)((uintptr_t)addr & ~(uintptr_t)3); /* same page: pages are 4-byte aligned */
  long rc = syscall(SYS_futex, &woken, FUTEX_WAKE_OP | FUTEX_PRIVATE_FLAG, 0, NULL, word,
                    FUTEX_OP(FUTEX_OP_ADD, 0, FUTEX_OP_CMP_EQ, 0));
  return rc >= 0 ? 1 : errno == EFAULT ? 0 : -1;
}

/* The first of addrs[0..n) that cannot be written (n: all can), or -1 when the kernel would not say. One call a
 * probe: the route for up to PAKV_FUTEX_PROBES, and for any number where the pipe cannot say. */
static int64_t futex_first_unwritable(void* const* addrs, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    int writable = futex_probe(addrs[i]);
    if (writable <= 0) return writable < 0 ? -1 : i;
  }
  return n;
}
#endif

int64_t pakv_first_unwritable(void* const* addrs, int64_t n) {
#if defined(__linux__)
  if (n <= 0) return 0;
  if (n <= PAKV_FUTEX_PROBES) {
    int64_t first = futex_first_unwritable(addrs, n);
    if (first >= 0) return first;
  }
  pthread_once(&g_probe_once, register_fork_handlers);
  lock_probe();
  int64_t first = n;
  if (g_probe_pipe[0] < 0 && pipe2(g_probe_pipe, O_CLOEXEC)) g_probe_pipe[0] = g_probe_pipe[1] = -1, first = -1;
  for (int64_t done = 0; first == n && done < n; done += PAKV_PROBES_PER_CALL) {
    int k = n - done < PAKV_PROBES_PER_CALL ? (int)(n - done) : PAKV_PROBES_PER_CALL;
    int64_t bad = probe_batch(addrs + done, k);
    if (bad < 0) first = -1;
    else if (bad < k) first = done + bad;
  }
  unlock_probe();
  /* The pipe could not be made or would not say: never let the write go ahead unasked while futex can ask
   * (a read-only pool written anyway is SIGSEGV: seen with 4 probes in a process out of descriptors). */
  if (first < 0 && n > PAKV_FUTEX_PROBES) first = futex_first_unwritable(addrs, n); /* fewer: futex was asked first */
  return first;
#else
  (void)addrs;
  return n > 0 ? -1 : 0;
#endif
}

/* [lo, hi]: the lowest and highest byte a scatter writes in one cache, over its tokens with a slot in
 * [0, capacity); 0 when it writes none there. */
static int written_bytes(const pakv_scatter_plan* p, const char* cache, int64_t stride, int64_t row, char** lo,
                         char** hi) {
  const int64_t bs = p->block_size, capacity = p->num_blocks * bs; /* fits: pakv_check_scatter_plan */
  const int nz = p->layout == PAKV_LAYOUT_NZ;
  int any = 0;
  if (row <= 0) return 0;
  for (int64_t t = 0; t < p->num_tokens; t++) {
    int64_t s = pakv_slot_entry(p, t);
    if (s < 0 || s >= capacity) continue;
    const char* block = cache + (s / bs) * stride;
    const char* first = block + (s % bs) * (nz ? PAKV_NZ_FRACTAL_BYTES : row);
    const char* last = nz ? block + ((row / PAKV_NZ_FRACTAL_BYTES - 1) * bs + s % bs + 1) * PAKV_NZ_FRACTAL_BYTES - 1
                          : first + row - 1;
    if (!any || (uintptr_t)first < (uintptr_t)*lo) *lo = (char*)first;
    if (!any || (uintptr_t)last > (uintptr_t)*hi) *hi = (char*)last;
    any = 1;
  }
  return any;
}

/* Two bytes in one 4 KiB page (the smallest page there is) share its protection: one probe serves both. */
static int same_page(const char* a, const char* b) { return ((uintptr_t)a >> 12) == ((uintptr_t)b >> 12); }

int pakv_check_spans_writable(char* const* lo, char* const* hi, const char* const* names, int n, pakv_err* err) {
  void* probes[2 * PAKV_MAX_SPANS];
  const char* named[2 * PAKV_MAX_SPANS];
  int64_t count = 0;
  for (int i = 0; i < n && i < PAKV_MAX_SPANS; i++) {
    if (!lo[i]) continue; /* nothing written there */
    probes[count] = lo[i], named[count++] = names[i];
    if (!same_page(lo[i], hi[i])) probes[count] = hi[i], named[count++] = names[i];
  }
  int64_t first = pakv_first_unwritable(probes, count);
  if (first < 0 || first >= count) return 0; /* writable, or the kernel would not say (the write goes ahead) */
  return pakv_fail(err,
                   "%s: the rows this write goes to are not writable memory (read-only or unmapped, at address %p): "
                   "nothing was written",
                   named[first], probes[first]);
}

int pakv_check_scatter_writable(const pakv_scatter_plan* p, const char* key_name, const char* value_name,
                                pakv_err* err) {
  char *lo[2] = {NULL, NULL}, *hi[2] = {NULL, NULL};
  const char* names[2] = {key_name, value_name};
  if (!written_bytes(p, (const char*)p->key_cache, p->key_block_stride, p->key_row_bytes, &lo[0], &hi[0]))
    lo[0] = NULL;
  if (!written_bytes(p, (const char*)p->value_cache, p->value_block_stride, p->value_row_bytes, &lo[1], &hi[1]))
    lo[1] = NULL;
  return pakv_check_spans_writable(lo, hi, names, 2, err);
}

int pakv_check_buffer_writable(void* data, int64_t bytes, const char* name, pakv_err* err) {
  if (bytes <= 0) return 0;
  void* probes[2] = {data, (char*)data + bytes - 1};
  int64_t first = pakv_first_unwritable(probes, 2);
  if (first < 0 || first >= 2) return 0;
  return pakv_fail(err, "%s: the buffer is not writable memory (read-only or unmapped, at address %p): nothing was written",
                   name, probes[first]);
}

static int report(int rc, const pakv_err* err, char* err_out, size_t err_len) {
  if (rc && err_out && err_len) {
    size_t i = 0;
    for (; i + 1 < err_len && err->msg[i]; i++) err_out[i] = err->msg[i];
    err_out[i] = 0;
  }
  return rc;
}

/* Exported entry point (the Python front, before a Python backend writes host memory): a buffer of `bytes`
 * (its name in the message). A scatter plan's caches: pakv_scatter_writable in pakv_core.c. */
PAKV_EXPORT int pakv_buffer_writable(void* data, int64_t bytes, const char* name, char* err_out, size_t err_len) {
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  return report(pakv_check_buffer_writable(data, bytes, name ? name : "a buffer", &err), &err, err_out, err_len);
}
