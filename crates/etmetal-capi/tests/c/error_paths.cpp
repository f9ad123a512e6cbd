// The C API's error paths, from C++ (built with -fsanitize=address,undefined
// by tests/c_programs.rs): bad files and bytes, wrong dtypes, shapes, sizes
// and counts, null pointers, output buffers too small or overlapping an
// input; each call fails with the status and a message naming what is
// wrong, leaves the program usable, and the right call still gives the
// same outputs. Also: dynamic shapes, the thread-local last error, and
// executes from several threads at once.
//
//   error_paths CPU.pte DYNAMIC.pte GPU.pte MALFORMED.pte MODEL.pt2
//
// CPU.pte takes one float32 [2, 4] input and gives one float32 [2, 3]
// output; DYNAMIC.pte the same with every dim dynamic up to [8, 4]; GPU.pte
// has GPU delegates. It ends with the line "N passed, N failed".
#include <etmetal.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

namespace {

int passed = 0, failed = 0;

void check(bool ok, const char *what, int line) {
    if (ok) {
        passed++;
    } else {
        failed++;
        std::fprintf(stderr, "FAILED (line %d): %s; last error: %s\n", line, what,
                     etmetal_last_error_message());
    }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

// The last call failed with `status` and a message containing `text`.
void expect_error(EtmetalStatus got, EtmetalStatus want, const char *text, int line) {
    std::string message = etmetal_last_error_message();
    bool ok = got == want && etmetal_last_error_status() == want &&
              message.find(text) != std::string::npos;
    if (ok) {
        passed++;
        return;
    }
    failed++;
    std::fprintf(stderr, "FAILED (line %d): expected %s containing \"%s\", got %s: \"%s\"\n", line,
                 etmetal_status_name(want), text, etmetal_status_name(got), message.c_str());
}
#define EXPECT_ERROR(call, status, text) expect_error((call), (status), (text), __LINE__)

EtmetalInput input(EtmetalDtype dtype, std::vector<size_t> shape, const void *data,
                   size_t nbytes) {
    EtmetalInput in{};
    in.dtype = dtype;
    in.rank = shape.size();
    for (size_t d = 0; d < shape.size() && d < ETMETAL_MAX_DIMS; d++) in.shape[d] = shape[d];
    in.data = data;
    in.nbytes = nbytes;
    return in;
}

EtmetalOutput output(std::vector<float> &buffer) {
    EtmetalOutput out{};
    out.data = buffer.data();
    out.capacity = buffer.size() * sizeof(float);
    return out;
}

std::vector<unsigned char> read_file(const char *path) {
    std::ifstream f(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// forward of the CPU program on `x` (8 floats) into `y` (6 floats).
EtmetalStatus run(EtmetalMethod *m, const std::vector<float> &x, std::vector<float> &y) {
    EtmetalInput in = input(ETMETAL_DTYPE_FLOAT32, {2, 4}, x.data(), x.size() * sizeof(float));
    EtmetalOutput out = output(y);
    return etmetal_method_execute(m, &in, 1, &out, 1);
}

void statuses() {
    CHECK(std::string(etmetal_version()) == ETMETAL_VERSION);
    CHECK(etmetal_status_exit_code(ETMETAL_STATUS_OK) == 0);
    CHECK(etmetal_status_exit_code(ETMETAL_STATUS_INVALID_INPUT) == 2);
    CHECK(etmetal_status_exit_code(ETMETAL_STATUS_FORMAT) == 2);
    CHECK(etmetal_status_exit_code(ETMETAL_STATUS_INTERNAL) == 1);
    CHECK(std::string(etmetal_status_name(ETMETAL_STATUS_IO)) == "io");
    CHECK(std::string(etmetal_status_name(1234)) == "unknown");
    CHECK(std::string(etmetal_dtype_name(ETMETAL_DTYPE_BFLOAT16)) == "bfloat16");
    CHECK(etmetal_dtype_size(ETMETAL_DTYPE_INT64) == 8);
    CHECK(etmetal_dtype_name(99) == nullptr);
    EXPECT_ERROR(etmetal_last_error_status(), ETMETAL_STATUS_INVALID_INPUT, "dtype 99");
    CHECK(etmetal_dtype_size(-1) == 0);
    // null handles
    etmetal_program_free(nullptr);
    etmetal_method_free(nullptr);
    CHECK(etmetal_program_method_count(nullptr) == 0);
    EXPECT_ERROR(etmetal_last_error_status(), ETMETAL_STATUS_INVALID_INPUT,
                 "etmetal_program_method_count: argument `program` is null");
    CHECK(etmetal_method_input_count(nullptr) == 0);
    CHECK(etmetal_method_name(nullptr) == nullptr);
    CHECK(etmetal_program_device(nullptr) == nullptr);
    EXPECT_ERROR(etmetal_program_reset_state(nullptr), ETMETAL_STATUS_INVALID_INPUT,
                 "`program` is null");
    EXPECT_ERROR(etmetal_method_execute(nullptr, nullptr, 0, nullptr, 0),
                 ETMETAL_STATUS_INVALID_INPUT, "`method` is null");
    // a success clears the last error
    CHECK(etmetal_dtype_size(ETMETAL_DTYPE_FLOAT32) == 4);
    CHECK(etmetal_last_error_status() == ETMETAL_STATUS_OK);
    CHECK(std::string(etmetal_last_error_message()).empty());
}

void loading(const char *cpu, const char *gpu, const char *malformed, const char *pt2) {
    EtmetalProgram *p = reinterpret_cast<EtmetalProgram *>(&passed); // not NULL
    EXPECT_ERROR(etmetal_program_load(nullptr, "cpu", &p), ETMETAL_STATUS_INVALID_INPUT,
                 "etmetal_program_load: argument `path` is null");
    CHECK(p == nullptr);
    EXPECT_ERROR(etmetal_program_load(cpu, "cpu", nullptr), ETMETAL_STATUS_INVALID_INPUT,
                 "argument `out` is null");
    EXPECT_ERROR(etmetal_program_load("/no/such/model.pte", "cpu", &p), ETMETAL_STATUS_IO,
                 "/no/such/model.pte");
    CHECK(etmetal_status_exit_code(etmetal_last_error_status()) == 2);
    EXPECT_ERROR(etmetal_program_load(malformed, "cpu", &p), ETMETAL_STATUS_FORMAT, malformed);
    EXPECT_ERROR(etmetal_program_load(pt2, "cpu", &p), ETMETAL_STATUS_FORMAT, "etmetal compile");
    EXPECT_ERROR(etmetal_program_load(cpu, "tpu", &p), ETMETAL_STATUS_INVALID_INPUT,
                 "device `tpu`: expected auto, metal, vulkan, dx12 or cpu");
    // a program with GPU delegates and the CPU asked for: an error, no fallback
    EXPECT_ERROR(etmetal_program_load(gpu, "cpu", &p), ETMETAL_STATUS_UNSUPPORTED,
                 "which needs a GPU");
    CHECK(p == nullptr);

    std::vector<unsigned char> bytes = read_file(cpu);
    CHECK(bytes.size() > 8);
    EXPECT_ERROR(etmetal_program_load_bytes(nullptr, 10, "cpu", &p),
                 ETMETAL_STATUS_INVALID_INPUT, "argument `data` is null");
    std::vector<unsigned char> garbage(bytes.begin(), bytes.begin() + bytes.size() / 2);
    EXPECT_ERROR(etmetal_program_load_bytes(garbage.data(), garbage.size(), "cpu", &p),
                 ETMETAL_STATUS_FORMAT, "the program in memory");
    std::vector<unsigned char> bad = read_file(malformed);
    EXPECT_ERROR(etmetal_program_load_bytes(bad.data(), bad.size(), nullptr, &p),
                 ETMETAL_STATUS_FORMAT, "");

    // the same program from bytes (released right after) and from the path
    EtmetalProgram *from_bytes = nullptr, *from_path = nullptr;
    CHECK(etmetal_program_load_bytes(bytes.data(), bytes.size(), "auto", &from_bytes) ==
          ETMETAL_STATUS_OK);
    std::fill(bytes.begin(), bytes.end(), 0);
    // a GPU asked for a program without GPU delegates: the CPU, and a warning
    CHECK(etmetal_program_load(cpu, "vulkan", &from_path) == ETMETAL_STATUS_OK);
    CHECK(std::string(etmetal_program_device(from_path)) == "cpu");
    CHECK(etmetal_program_warning(from_path) != nullptr &&
          std::string(etmetal_program_warning(from_path)).find("is not used") !=
              std::string::npos);
    CHECK(etmetal_program_warning(from_bytes) == nullptr);
    EtmetalMethod *a = nullptr, *b = nullptr;
    CHECK(etmetal_program_method(from_bytes, nullptr, &a) == ETMETAL_STATUS_OK);
    CHECK(etmetal_program_method(from_path, "forward", &b) == ETMETAL_STATUS_OK);
    etmetal_program_free(from_bytes);
    etmetal_program_free(from_path);
    std::vector<float> x = {0.5f, -1.0f, 2.0f, 0.25f, 1.5f, -0.75f, 0.0f, 3.0f};
    std::vector<float> ya(6, NAN), yb(6, NAN);
    CHECK(run(a, x, ya) == ETMETAL_STATUS_OK);
    CHECK(run(b, x, yb) == ETMETAL_STATUS_OK);
    CHECK(std::memcmp(ya.data(), yb.data(), 6 * sizeof(float)) == 0);
    CHECK(std::isfinite(ya[0]) && std::isfinite(ya[5]));
    etmetal_method_free(a);
    etmetal_method_free(b);
}

void methods_and_specs(EtmetalProgram *p, EtmetalMethod *m) {
    CHECK(etmetal_program_method_count(p) == 1);
    CHECK(std::string(etmetal_program_method_name(p, 0)) == "forward");
    CHECK(etmetal_program_method_name(p, 3) == nullptr);
    EXPECT_ERROR(etmetal_last_error_status(), ETMETAL_STATUS_INVALID_INPUT,
                 "method 3 does not exist (1 methods)");
    EtmetalMethod *none = reinterpret_cast<EtmetalMethod *>(&passed);
    EXPECT_ERROR(etmetal_program_method(p, "prefill", &none), ETMETAL_STATUS_INVALID_INPUT,
                 "no method `prefill` in the program (methods: forward)");
    CHECK(none == nullptr);
    EXPECT_ERROR(etmetal_program_method(nullptr, "forward", &none), ETMETAL_STATUS_INVALID_INPUT,
                 "`program` is null");
    EXPECT_ERROR(etmetal_program_method(p, "forward", nullptr), ETMETAL_STATUS_INVALID_INPUT,
                 "`out` is null");

    CHECK(std::string(etmetal_method_name(m)) == "forward");
    CHECK(etmetal_method_input_count(m) == 1 && etmetal_method_output_count(m) == 1);
    EtmetalTensorSpec spec;
    CHECK(etmetal_method_input_spec(m, 0, &spec) == ETMETAL_STATUS_OK);
    CHECK(spec.dtype == ETMETAL_DTYPE_FLOAT32 && spec.rank == 2 && spec.shape[0] == 2 &&
          spec.shape[1] == 4 && !spec.dynamic[0] && spec.nbytes == 32);
    CHECK(etmetal_method_output_spec(m, 0, &spec) == ETMETAL_STATUS_OK);
    CHECK(spec.rank == 2 && spec.shape[1] == 3 && spec.nbytes == 24);
    EXPECT_ERROR(etmetal_method_input_spec(m, 1, &spec), ETMETAL_STATUS_INVALID_INPUT,
                 "input 1 does not exist (the method has 1)");
    EXPECT_ERROR(etmetal_method_output_spec(m, 0, nullptr), ETMETAL_STATUS_INVALID_INPUT,
                 "argument `spec` is null");

    EtmetalProgramCounters pc;
    CHECK(etmetal_program_counters(p, &pc) == ETMETAL_STATUS_OK);
    CHECK(pc.methods == 1 && pc.constant_bytes > 0 && pc.named_data_keys == 0);
    EtmetalMethodCounters mc;
    CHECK(etmetal_method_counters(m, &mc) == ETMETAL_STATUS_OK);
    CHECK(mc.gpu_partitions == 0 && mc.delegate_calls == 0 && mc.cpu_kernel_calls > 0 &&
          mc.cpu_operators > 0 && mc.planned_memories > 0);
    const char *op = nullptr;
    size_t calls = 0, total = 0;
    for (size_t i = 0; i < mc.cpu_operators; i++) {
        CHECK(etmetal_method_cpu_operator(m, i, &op, &calls) == ETMETAL_STATUS_OK);
        CHECK(op && std::strncmp(op, "aten::", 6) == 0 && calls > 0);
        total += calls;
    }
    CHECK(total == mc.cpu_kernel_calls);
    EXPECT_ERROR(etmetal_method_cpu_operator(m, mc.cpu_operators, &op, &calls),
                 ETMETAL_STATUS_INVALID_INPUT, "does not exist");
    EXPECT_ERROR(etmetal_method_counters(m, nullptr), ETMETAL_STATUS_INVALID_INPUT,
                 "`counters` is null");
}

void wrong_inputs_and_outputs(EtmetalMethod *m, const std::vector<float> &want) {
    std::vector<float> x = {0.5f, -1.0f, 2.0f, 0.25f, 1.5f, -0.75f, 0.0f, 3.0f};
    std::vector<int32_t> ints(8, 1);
    std::vector<float> y(6), small(2), big(16);
    EtmetalOutput out = output(y);
    EtmetalInput in;

    in = input(ETMETAL_DTYPE_INT32, {2, 4}, ints.data(), 32);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "input 0: expected float32 [2, 4], got int32 [2, 4]");
    in = input(77, {2, 4}, x.data(), 32);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "input 0: dtype 77 is no ETMETAL_DTYPE_*");
    in = input(ETMETAL_DTYPE_FLOAT32, {2, 3}, x.data(), 24);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "input 0: expected float32 [2, 4], got float32 [2, 3]");
    in = input(ETMETAL_DTYPE_FLOAT32, {8}, x.data(), 32);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "got float32 [8]");
    in = input(ETMETAL_DTYPE_FLOAT32, {2, 4}, x.data(), 32);
    in.rank = ETMETAL_MAX_DIMS + 1;
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "rank 17, above ETMETAL_MAX_DIMS");
    in = input(ETMETAL_DTYPE_FLOAT32, {2, 4}, x.data(), 28);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "input 0: 28 bytes given for float32 [2, 4], which needs 32");
    in = input(ETMETAL_DTYPE_FLOAT32, {2, 4}, nullptr, 32);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "argument `inputs[0].data` is null");
    in = input(ETMETAL_DTYPE_FLOAT32, {2, 4}, x.data(), 32);
    EXPECT_ERROR(etmetal_method_execute(m, nullptr, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "argument `inputs` is null");
    EXPECT_ERROR(etmetal_method_execute(m, &in, 0, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "the program takes 1 input(s), 0 given");
    EtmetalInput two[2] = {in, in};
    EXPECT_ERROR(etmetal_method_execute(m, two, 2, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "takes 1 input(s), 2 given");
    // outputs
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, nullptr, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "argument `outputs` is null");
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 0), ETMETAL_STATUS_INVALID_INPUT,
                 "method `forward` gives 1 output(s), 0 given");
    EtmetalOutput tight = output(small);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &tight, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "output 0: float32 [2, 3] needs 24 bytes, its buffer has 8");
    EtmetalOutput null_data = out;
    null_data.data = nullptr;
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &null_data, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "argument `outputs[0].data` is null");
    // an output written over its own input: refused, not raced
    std::vector<float> shared(x);
    EtmetalInput in_place = input(ETMETAL_DTYPE_FLOAT32, {2, 4}, shared.data(), 32);
    EtmetalOutput over = output(shared);
    EXPECT_ERROR(etmetal_method_execute(m, &in_place, 1, &over, 1),
                 ETMETAL_STATUS_INVALID_INPUT, "output 0: its buffer overlaps input 0's");

    // after all that, the right call gives the same values, and a larger
    // buffer is fine: only nbytes of it are written
    std::fill(big.begin(), big.end(), -7.0f);
    EtmetalOutput roomy = output(big);
    CHECK(etmetal_method_execute(m, &in, 1, &roomy, 1) == ETMETAL_STATUS_OK);
    CHECK(roomy.dtype == ETMETAL_DTYPE_FLOAT32 && roomy.rank == 2 && roomy.shape[0] == 2 &&
          roomy.shape[1] == 3 && roomy.nbytes == 24);
    CHECK(std::memcmp(big.data(), want.data(), 24) == 0);
    CHECK(big[6] == -7.0f);
}

void dynamic_shapes(const char *path) {
    EtmetalProgram *p = nullptr;
    EtmetalMethod *m = nullptr;
    CHECK(etmetal_program_load(path, "cpu", &p) == ETMETAL_STATUS_OK);
    CHECK(etmetal_program_method(p, "forward", &m) == ETMETAL_STATUS_OK);
    etmetal_program_free(p);
    EtmetalTensorSpec in_spec, out_spec;
    CHECK(etmetal_method_input_spec(m, 0, &in_spec) == ETMETAL_STATUS_OK);
    CHECK(etmetal_method_output_spec(m, 0, &out_spec) == ETMETAL_STATUS_OK);
    CHECK(in_spec.dynamic[0] && in_spec.shape[0] == 8 && in_spec.nbytes == 8 * 4 * 4);
    CHECK(out_spec.dynamic[0] && out_spec.nbytes == 8 * 3 * 4);
    std::vector<float> x(9 * 4, 0.5f), y(8 * 3, NAN);
    EtmetalOutput out = output(y);
    // 5 rows of up to 8
    EtmetalInput in = input(ETMETAL_DTYPE_FLOAT32, {5, 4}, x.data(), 5 * 4 * 4);
    CHECK(etmetal_method_execute(m, &in, 1, &out, 1) == ETMETAL_STATUS_OK);
    CHECK(out.rank == 2 && out.shape[0] == 5 && out.shape[1] == 3 && out.nbytes == 5 * 3 * 4);
    CHECK(y[0] == y[3] && y[14] == y[2] && std::isnan(y[15]));
    // above the bound
    in = input(ETMETAL_DTYPE_FLOAT32, {9, 4}, x.data(), 9 * 4 * 4);
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "input 0: dim 0 is 9, above its upper bound 8");
    // a dynamic output's buffer is checked once its size is known
    in = input(ETMETAL_DTYPE_FLOAT32, {5, 4}, x.data(), 5 * 4 * 4);
    out.capacity = 4 * 3 * 4;
    EXPECT_ERROR(etmetal_method_execute(m, &in, 1, &out, 1), ETMETAL_STATUS_INVALID_INPUT,
                 "output 0: float32 [5, 3] needs 60 bytes, its buffer has 48");
    in = input(ETMETAL_DTYPE_FLOAT32, {1, 4}, x.data(), 16);
    CHECK(etmetal_method_execute(m, &in, 1, &out, 1) == ETMETAL_STATUS_OK);
    CHECK(out.shape[0] == 1 && out.nbytes == 12 && y[0] == y[3]);
    etmetal_method_free(m);
}

void threads(EtmetalMethod *m, const std::vector<float> &want) {
    std::atomic<int> wrong{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < 4; t++) {
        pool.emplace_back([&, t] {
            std::vector<float> x = {0.5f, -1.0f, 2.0f, 0.25f, 1.5f, -0.75f, 0.0f, 3.0f};
            for (int i = 0; i < 25; i++) {
                std::vector<float> y(6);
                if (run(m, x, y) != ETMETAL_STATUS_OK || y != want) wrong++;
                // each thread has its own last error
                if (t == 0 && etmetal_method_execute(m, nullptr, 1, nullptr, 0) !=
                                  ETMETAL_STATUS_INVALID_INPUT)
                    wrong++;
                if (t != 0 && etmetal_last_error_status() != ETMETAL_STATUS_OK) wrong++;
            }
        });
    }
    for (auto &t : pool) t.join();
    CHECK(wrong == 0);
}

} // namespace

int main(int argc, char **argv) {
    if (argc != 6) {
        std::fprintf(stderr, "usage: error_paths CPU.pte DYNAMIC.pte GPU.pte MALFORMED.pte "
                             "MODEL.pt2\n");
        return 2;
    }
    statuses();
    loading(argv[1], argv[3], argv[4], argv[5]);
    EtmetalProgram *p = nullptr;
    EtmetalMethod *m = nullptr;
    CHECK(etmetal_program_load(argv[1], "cpu", &p) == ETMETAL_STATUS_OK);
    CHECK(etmetal_program_method(p, "forward", &m) == ETMETAL_STATUS_OK);
    if (p && m) {
        std::vector<float> x = {0.5f, -1.0f, 2.0f, 0.25f, 1.5f, -0.75f, 0.0f, 3.0f};
        std::vector<float> want(6);
        CHECK(run(m, x, want) == ETMETAL_STATUS_OK);
        methods_and_specs(p, m);
        wrong_inputs_and_outputs(m, want);
        threads(m, want);
        CHECK(etmetal_program_reset_state(p) == ETMETAL_STATUS_OK);
    }
    etmetal_method_free(m);
    etmetal_program_free(p);
    dynamic_shapes(argv[2]);
    std::printf("%d passed, %d failed\n", passed, failed);
    std::fflush(stdout);
    return failed == 0 ? 0 : 1;
}
