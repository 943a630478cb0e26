// gpu_hold: one thread waits `ns` nanoseconds of the global timer, then returns.  Launched
// before a profiled step (lockstep profile --kernels) so the host can enqueue every node and its
// timing events while the GPU waits: the events then time GPU work, not host launch gaps.
__global__ void gpu_hold(long long ns) {
    PDL_ENTER();
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}
