/* Errors: a failed check sets its message and kind (see pakv_core.h's pakv_err). The lowest unit of the
 * library: every other one reports through it, it stands on none. */
#include <stdarg.h>
#include <stdio.h>

#include "pakv_core.h"

int pakv_fail(pakv_err* err, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
  va_end(ap);
  err->kind = PAKV_ERR_VALUE;
  return -1;
}

int pakv_fail_type(pakv_err* err, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
  va_end(ap);
  err->kind = PAKV_ERR_TYPE;
  return -1;
}
