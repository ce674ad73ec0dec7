/* backend/nocuda: the CUDA backend's entry points in a build without CUDA.
 *
 * The Makefile compiles this file only when CUDA=1 is not given (and the files
 * under src/backend/cuda only when it is), so core code asks for the GPU through
 * the same functions in both builds and never needs an #ifdef. */
#include "backend/backend.h"

int dsv4_backend_cuda_available(void) { return 0; }

int dsv4_backend_cuda_built(void) { return 0; }

int dsv4_backend_cuda_init(dsv4_backend *b, int device, dsv4_err *err) {
    (void)b;
    (void)device;
    return dsv4_errf(err, "backend 'cuda': this dsv4 was built without CUDA (rebuild with `make CUDA=1`)");
}

void dsv4_backend_cuda_free(dsv4_backend *b) { (void)b; }
