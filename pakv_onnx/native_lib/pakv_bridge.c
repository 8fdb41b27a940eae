#define _POSIX_C_SOURCE 200809L /* nanosleep */
/* The Python bridge (see pakv_bridge.h): backend registry, the callback, exit handling, and the
 * helper the callback uses to report an error (its outputs: pakv_request_output, in pakv_ort.c). */
#include "pakv_bridge.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef int (*pakv_python_fn)(pakv_request* req);

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_backend_names[PAKV_MAX_BACKENDS][PAKV_BACKEND_NAME_LEN] = {"native"};
static int g_backend_count = 1;
static _Atomic(pakv_python_fn) g_python_fn = NULL;
static atomic_int g_python_enabled = 0;
static atomic_long g_python_inflight = 0;

int pakv_backend_slot(const char* name) {
  if (!name || !*name || strlen(name) >= PAKV_BACKEND_NAME_LEN) return -1;
  pthread_mutex_lock(&g_lock);
  int slot = -1;
  for (int i = 0; i < g_backend_count; i++)
    if (strcmp(g_backend_names[i], name) == 0) slot = i;
  if (slot < 0 && g_backend_count < PAKV_MAX_BACKENDS) {
    slot = g_backend_count;
    snprintf(g_backend_names[slot], PAKV_BACKEND_NAME_LEN, "%s", name);
    g_backend_count++; /* published after the name is written (readers take names of slots they were given) */
  }
  pthread_mutex_unlock(&g_lock);
  return slot;
}

const char* pakv_backend_name(int slot) {
  return slot >= 0 && slot < PAKV_MAX_BACKENDS ? g_backend_names[slot] : "?";
}

PAKV_EXPORT void pakv_set_python_callback(pakv_python_fn fn) {
  atomic_store(&g_python_fn, fn);
  atomic_store(&g_python_enabled, fn != NULL);
}

/* Interpreter exit: stop new calls into Python, then wait for the calls in flight (they run with
 * the GIL released by this wait). A call still inside Python when the interpreter finalizes
 * would be killed mid-frame (SIGABRT), so the wait lasts until they finish, up to timeout_ms;
 * a note goes to stderr once after notice_ms. Returns the calls still in flight. */
PAKV_EXPORT long pakv_python_shutdown(long timeout_ms, long notice_ms) {
  atomic_store(&g_python_enabled, 0);
  for (long waited = 0; waited < timeout_ms; waited++) {
    long inflight = atomic_load(&g_python_inflight);
    if (inflight == 0) break;
    if (waited == notice_ms)
      fprintf(stderr, "pakv_onnx: waiting for %ld Python-backend call(s) in flight to finish before exit\n",
              inflight);
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return atomic_load(&g_python_inflight);
}

int pakv_call_python(int slot, pakv_request* req) {
  atomic_fetch_add(&g_python_inflight, 1);
  pakv_python_fn fn = atomic_load(&g_python_fn);
  if (!atomic_load(&g_python_enabled) || !fn) {
    atomic_fetch_sub(&g_python_inflight, 1);
    snprintf(req->error, sizeof(req->error),
             "GatherPaKvCache backend '%s' needs the Python bridge (pakv_onnx.runtime_plugin), which is not active in "
             "this process (never imported, or the interpreter is shutting down); use backend 'native'",
             pakv_backend_name(slot));
    return -1;
  }
  req->backend = pakv_backend_name(slot);
  req->error[0] = 0;
  int rc = fn(req);
  atomic_fetch_sub(&g_python_inflight, 1);
  if (rc != 0 && !req->error[0]) snprintf(req->error, sizeof(req->error), "Python backend failed");
  return rc != 0 ? -1 : 0;
}

PAKV_EXPORT void pakv_request_set_error(pakv_request* req, const char* msg) {
  if (req) snprintf(req->error, sizeof(req->error), "%s", msg ? msg : "unknown error");
}

PAKV_EXPORT size_t pakv_request_size(void) { return sizeof(pakv_request); }
