// Programmatic dependent launch (PDL, sm_90 and later), prepended to every kernel source by
// providers/cuda/module.py.  The cuda provider launches every kernel with the programmatic
// stream-serialization attribute (cuLaunchKernelEx), so kernel N + 1 may start while kernel N is
// still running.  Every kernel therefore begins with PDL_ENTER(): griddepcontrol.wait blocks
// until the previous kernel in the stream has completed and its memory is visible, and only then
// does griddepcontrol.launch_dependents let the next kernel start.  Invariant: while a kernel
// runs the code before its PDL_ENTER(), every kernel before its predecessor has completed.
// Code before PDL_ENTER() may therefore read only memory that no kernel of the current step
// writes (weights, cos/sin tables, a KV cache's rows of earlier steps), or read other memory
// through L2 as a guess that it checks after the wait (gqa_decode's positions); it must not
// write anything nor return early.
// On older architectures, and for a launch without the attribute, both are no-ops.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT() do { } while (0)
#define PDL_TRIGGER() do { } while (0)
#endif
#define PDL_ENTER() do { PDL_WAIT(); PDL_TRIGGER(); } while (0)
