// What this build and CPU run: the instruction sets of the SIMD paths (kvd_isa), whether Linux lends the AMX
// tiles, and which linear each weight takes (kvd_linear).

// syscall() (AMX permission) is a GNU extension under -std=c11.
#define _GNU_SOURCE
#include "cpu_internal.h"

#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

// Linux lends the tile registers to a process that asks once (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
int amx_permitted(void) {
    static int state;  // 0 unknown, 1 yes, -1 no
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state > 0;
}
#endif

// The SIMD paths' instruction sets, as kvd_isa names them (cpu_kernels.h).
#if KVD_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define KVD_ISA_VNNI "+vnni"
#else
#define KVD_ISA_VNNI ""
#endif
#if KVD_AMX
#define KVD_ISA_AMX "+amx-int8"
#else
#define KVD_ISA_AMX ""
#endif
#if KVD_AMX_BF16
#define KVD_ISA_AMX_BF16 "+amx-bf16"
#else
#define KVD_ISA_AMX_BF16 ""
#endif
#if KVD_AVX512_BF16
#define KVD_ISA_AVX512 "+avx512-bf16"
#elif KVD_AVX512
#define KVD_ISA_AVX512 "+avx512"
#else
#define KVD_ISA_AVX512 ""
#endif
#define KVD_ISA_NO_AMX (KVD_AVX2 ? "avx2+fma" KVD_ISA_AVX512 KVD_ISA_VNNI : "portable")
#define KVD_ISA (KVD_AVX2 ? "avx2+fma" KVD_ISA_AVX512 KVD_ISA_VNNI KVD_ISA_AMX KVD_ISA_AMX_BF16 : "portable")

const char* kvd_isa(void) {
#if KVD_AMX || KVD_AMX_BF16
    if (!amx_permitted()) return KVD_ISA_NO_AMX;  // Linux refused the tiles: the other paths run
#endif
    return KVD_ISA;
}

int kvd_bf16_kernel_order(void) {
#if KVD_AMX_BF16
    if (amx_permitted()) return 1;
#endif
    return KVD_AVX512_BF16;
}

// GGUF super-block weights to their linears; float weights, and any weight in tile order (which only a float weight
// may be in), to the float linears; 4- and 8-bit ones to the quantized.
int kvd_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16, int nthreads) {
    if (w->ggml && w->ggml != KVD_GGML_F16) return super_weight_linear(w, x, x_bf16, M, y, y_bf16, nthreads);
    if (w->tiles || w->bits == 32 || w->bits == 16) return float_weight_linear(w, x, x_bf16, M, y, y_bf16, nthreads);
    return quantized_weight_linear(w, x, x_bf16, M, y, y_bf16, nthreads);
}
