/* backend/cpu: the CPU reference backend (see backend/backend.h for the ops).
 * Init/free are declared in backend.h; this header adds CPU-only introspection. */
#ifndef DSV4_BACKEND_CPU_CPU_H
#define DSV4_BACKEND_CPU_CPU_H

#include "backend/backend.h"

/* Number of scratch allocations that did not fit the arena since init (tests
 * check it stops growing after the first calls: nothing allocated per token). */
long dsv4_backend_cpu_spills(dsv4_backend *b);
/* side chains the forward pass opened (which 0) and joined (which 1) since init */
long dsv4_backend_cpu_sides(dsv4_backend *b, int which);

#endif
