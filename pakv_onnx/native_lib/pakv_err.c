/* Errors: a failed check sets its message and kind (see pakv_core.h's pakv_err). The lowest unit of the
 * library: every other one reports through it, it stands on none. */
#include <stdarg.h>
#include <stdio.h>

#include "pakv_core.h"

/* The message of `fmt` and its arguments into err, and the error's kind; returns -1. */
static int fail(pakv_err* err, int kind, const char* fmt, va_list ap) {
  vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
  err->kind = kind;
  return -1;
}

int pakv_fail(pakv_err* err, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = fail(err, PAKV_ERR_VALUE, fmt, ap);
  va_end(ap);
  return rc;
}

int pakv_fail_type(pakv_err* err, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = fail(err, PAKV_ERR_TYPE, fmt, ap);
  va_end(ap);
  return rc;
}
