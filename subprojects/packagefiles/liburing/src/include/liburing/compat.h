/* SPDX-License-Identifier: MIT */
#ifndef LIBURING_COMPAT_H
#define LIBURING_COMPAT_H
#include <linux/time_types.h>
#include <linux/openat2.h>
#endif
