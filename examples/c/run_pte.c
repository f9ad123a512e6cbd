/* Load an ExecuTorch program (.pte), run one method and print its outputs,
 * through etmetal's C API (include/etmetal.h, libetmetal_capi).
 *
 *   run_pte MODEL.pte [--device auto|metal|vulkan|dx12|cpu] [--method NAME]
 *           [INPUT.npy]...
 *
 * Inputs come from .npy files (little-endian, C order, the input's dtype;
 * a dynamic input at any size up to its bound) or, with none given, are all
 * ones at each input's full shape, as `etmetal run` does. Each output is
 * printed as a line `output I: DTYPE [SHAPE]` and a line with all its
 * values. Errors print the library's message and exit with the code the
 * `etmetal` command would (2 bad input, 1 internal failure).
 *
 * Build (docs/EMBEDDING.md):
 *   cc -std=c11 run_pte.c $(pkg-config --cflags --libs etmetal) -o run_pte
 */
#include <etmetal.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what) {
    EtmetalStatus status = etmetal_last_error_status();
    fprintf(stderr, "run_pte: error (%s): %s%s%s\n", etmetal_status_name(status), what,
            *what ? ": " : "", etmetal_last_error_message());
    return etmetal_status_exit_code(status);
}

/* A .npy file's array: its dtype, shape and bytes (malloc'd). */
typedef struct {
    EtmetalDtype dtype;
    size_t rank;
    size_t shape[ETMETAL_MAX_DIMS];
    void *data;
    size_t nbytes;
} Array;

static int npy_dtype(const char *descr, EtmetalDtype *dtype) {
    static const struct {
        const char *descr;
        EtmetalDtype dtype;
    } table[] = {
        {"<f4", ETMETAL_DTYPE_FLOAT32}, {"<f8", ETMETAL_DTYPE_FLOAT64},
        {"<f2", ETMETAL_DTYPE_FLOAT16}, {"<i8", ETMETAL_DTYPE_INT64},
        {"<i4", ETMETAL_DTYPE_INT32},   {"<i2", ETMETAL_DTYPE_INT16},
        {"|i1", ETMETAL_DTYPE_INT8},    {"|u1", ETMETAL_DTYPE_UINT8},
        {"|b1", ETMETAL_DTYPE_BOOL},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(descr, table[i].descr) == 0) {
            *dtype = table[i].dtype;
            return 0;
        }
    }
    return -1;
}

/* Read `path` (.npy version 1 to 3) into `a`; 0 on success. */
static int read_npy(const char *path, Array *a) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "run_pte: cannot open %s\n", path);
        return -1;
    }
    unsigned char magic[8];
    size_t header_len = 0;
    int ok = fread(magic, 1, 8, f) == 8 && memcmp(magic, "\x93NUMPY", 6) == 0;
    if (ok && magic[6] == 1) {
        unsigned char n[2];
        ok = fread(n, 1, 2, f) == 2;
        header_len = n[0] | (size_t)n[1] << 8;
    } else if (ok) {
        unsigned char n[4];
        ok = fread(n, 1, 4, f) == 4;
        header_len = n[0] | (size_t)n[1] << 8 | (size_t)n[2] << 16 | (size_t)n[3] << 24;
    }
    char *header = ok ? calloc(header_len + 1, 1) : NULL;
    ok = header && fread(header, 1, header_len, f) == header_len;
    /* {'descr': '<f4', 'fortran_order': False, 'shape': (2, 8), } */
    char descr[8] = {0};
    const char *d = ok ? strstr(header, "'descr': '") : NULL;
    const char *s = ok ? strstr(header, "'shape': (") : NULL;
    ok = d && s && strstr(header, "'fortran_order': False") &&
         sscanf(d + 10, "%7[^']", descr) == 1 && npy_dtype(descr, &a->dtype) == 0;
    a->rank = 0;
    size_t numel = 1;
    for (s = ok ? s + 10 : NULL; s && *s != ')';) {
        char *end;
        unsigned long long dim = strtoull(s, &end, 10);
        if (end == s) {
            s = *s == ',' || *s == ' ' ? s + 1 : NULL;
            continue;
        }
        if (a->rank == ETMETAL_MAX_DIMS) {
            s = NULL;
            break;
        }
        a->shape[a->rank++] = (size_t)dim;
        numel *= (size_t)dim;
        s = end;
    }
    ok = ok && s;
    a->nbytes = ok ? numel * etmetal_dtype_size(a->dtype) : 0;
    a->data = ok ? malloc(a->nbytes ? a->nbytes : 1) : NULL;
    ok = a->data && fread(a->data, 1, a->nbytes, f) == a->nbytes;
    free(header);
    fclose(f);
    if (!ok) {
        fprintf(stderr, "run_pte: %s is not a .npy file this example reads\n", path);
        free(a->data);
        a->data = NULL;
        return -1;
    }
    return 0;
}

/* All ones of `spec` at its full shape. */
static int ones(const EtmetalTensorSpec *spec, Array *a) {
    size_t size = etmetal_dtype_size(spec->dtype), numel = spec->nbytes / size;
    a->dtype = spec->dtype;
    a->rank = spec->rank;
    memcpy(a->shape, spec->shape, sizeof a->shape);
    a->nbytes = spec->nbytes;
    a->data = malloc(a->nbytes ? a->nbytes : 1);
    if (!a->data) return -1;
    for (size_t i = 0; i < numel; i++) {
        unsigned char *e = (unsigned char *)a->data + i * size;
        float f32 = 1.0f;
        double f64 = 1.0;
        uint16_t half = spec->dtype == ETMETAL_DTYPE_BFLOAT16 ? 0x3F80 : 0x3C00;
        int64_t one = 1;
        switch (spec->dtype) {
        case ETMETAL_DTYPE_FLOAT32: memcpy(e, &f32, 4); break;
        case ETMETAL_DTYPE_FLOAT64: memcpy(e, &f64, 8); break;
        case ETMETAL_DTYPE_FLOAT16:
        case ETMETAL_DTYPE_BFLOAT16: memcpy(e, &half, 2); break;
        default: memcpy(e, &one, size); break; /* little-endian integers and bool */
        }
    }
    return 0;
}

static double half_to_double(uint16_t h, int bf16) {
    if (bf16) {
        uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    int exp = (h >> 10) & 0x1F, frac = h & 0x3FF;
    double v = exp == 0 ? frac / 1024.0 / 16384.0
             : exp == 31 ? (frac ? NAN : INFINITY)
                         : (1.0 + frac / 1024.0) * ((exp >= 15) ? (double)(1 << (exp - 15))
                                                                 : 1.0 / (1 << (15 - exp)));
    return (h & 0x8000) ? -v : v;
}

static void print_output(size_t i, const EtmetalOutput *o) {
    printf("output %zu: %s [", i, etmetal_dtype_name(o->dtype));
    for (size_t d = 0; d < o->rank; d++) printf(d ? ", %zu" : "%zu", o->shape[d]);
    printf("]\n ");
    size_t size = etmetal_dtype_size(o->dtype);
    for (size_t k = 0; k < o->nbytes / size; k++) {
        const unsigned char *e = (const unsigned char *)o->data + k * size;
        float f32;
        double f64;
        uint16_t half;
        int64_t i64 = 0;
        switch (o->dtype) {
        case ETMETAL_DTYPE_FLOAT32: memcpy(&f32, e, 4); printf(" %.9g", f32); break;
        case ETMETAL_DTYPE_FLOAT64: memcpy(&f64, e, 8); printf(" %.17g", f64); break;
        case ETMETAL_DTYPE_FLOAT16:
        case ETMETAL_DTYPE_BFLOAT16:
            memcpy(&half, e, 2);
            printf(" %.9g", half_to_double(half, o->dtype == ETMETAL_DTYPE_BFLOAT16));
            break;
        case ETMETAL_DTYPE_INT8: printf(" %d", *(const int8_t *)e); break;
        case ETMETAL_DTYPE_INT16: { int16_t v; memcpy(&v, e, 2); printf(" %d", v); break; }
        case ETMETAL_DTYPE_INT32: { int32_t v; memcpy(&v, e, 4); printf(" %d", v); break; }
        case ETMETAL_DTYPE_INT64: memcpy(&i64, e, 8); printf(" %lld", (long long)i64); break;
        default: printf(" %u", *e); break; /* uint8, bool */
        }
    }
    printf("\n");
}

int main(int argc, char **argv) {
    const char *model = NULL, *device = "auto", *method_name = "forward";
    const char *npys[64];
    size_t n_npys = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
            device = argv[++i];
        } else if (strcmp(argv[i], "--method") == 0 && i + 1 < argc) {
            method_name = argv[++i];
        } else if (!model) {
            model = argv[i];
        } else if (n_npys < 64) {
            npys[n_npys++] = argv[i];
        }
    }
    if (!model) {
        fprintf(stderr, "usage: run_pte MODEL.pte [--device auto|metal|vulkan|dx12|cpu] "
                        "[--method NAME] [INPUT.npy]...\n");
        return 2;
    }

    EtmetalProgram *program = NULL;
    if (etmetal_program_load(model, device, &program) != ETMETAL_STATUS_OK) return fail("");
    printf("etmetal %s, device: %s\n", etmetal_version(), etmetal_program_device(program));
    if (etmetal_program_warning(program)) {
        fprintf(stderr, "run_pte: warning: %s\n", etmetal_program_warning(program));
    }
    EtmetalMethod *method = NULL;
    if (etmetal_program_method(program, method_name, &method) != ETMETAL_STATUS_OK) {
        int code = fail("");
        etmetal_program_free(program);
        return code;
    }
    /* the method keeps what it needs: the program handle can go now */
    etmetal_program_free(program);

    EtmetalMethodCounters counters;
    etmetal_method_counters(method, &counters);
    printf("method %s: %zu GPU partition(s), %zu kernel(s), %zu dispatch(es); "
           "%zu CPU kernel call(s)\n",
           etmetal_method_name(method), counters.gpu_partitions, counters.gpu_kernels,
           counters.gpu_dispatches, counters.cpu_kernel_calls);

    size_t n_in = etmetal_method_input_count(method), n_out = etmetal_method_output_count(method);
    Array *arrays = calloc(n_in ? n_in : 1, sizeof *arrays);
    EtmetalInput *inputs = calloc(n_in ? n_in : 1, sizeof *inputs);
    EtmetalOutput *outputs = calloc(n_out ? n_out : 1, sizeof *outputs);
    int code = 0;
    if (n_npys && n_npys != n_in) {
        fprintf(stderr, "run_pte: %zu .npy file(s) for %zu input(s)\n", n_npys, n_in);
        code = 2;
    }
    for (size_t i = 0; i < n_in && code == 0; i++) {
        EtmetalTensorSpec spec;
        etmetal_method_input_spec(method, i, &spec);
        if ((n_npys ? read_npy(npys[i], &arrays[i]) : ones(&spec, &arrays[i])) != 0) {
            code = 2;
            break;
        }
        inputs[i].dtype = arrays[i].dtype;
        inputs[i].rank = arrays[i].rank;
        memcpy(inputs[i].shape, arrays[i].shape, sizeof inputs[i].shape);
        inputs[i].data = arrays[i].data;
        inputs[i].nbytes = arrays[i].nbytes;
    }
    for (size_t i = 0; i < n_out && code == 0; i++) {
        EtmetalTensorSpec spec;
        etmetal_method_output_spec(method, i, &spec); /* nbytes: enough at any size */
        outputs[i].capacity = spec.nbytes;
        outputs[i].data = malloc(spec.nbytes ? spec.nbytes : 1);
    }
    if (code == 0) {
        if (etmetal_method_execute(method, inputs, n_in, outputs, n_out) != ETMETAL_STATUS_OK) {
            code = fail("execute");
        } else {
            for (size_t i = 0; i < n_out; i++) print_output(i, &outputs[i]);
        }
    }
    for (size_t i = 0; i < n_in; i++) free(arrays[i].data);
    for (size_t i = 0; i < n_out; i++) free(outputs[i].data);
    free(arrays);
    free(inputs);
    free(outputs);
    etmetal_method_free(method);
    return code;
}
