// moe_ggml_bench: machine facts, seeded random data, statistics (declarations in moe_ggml.h).
#include "moe_ggml.h"

void logf_(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[ggml-bench] ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    std::stringstream        ss(s);
    std::string              item;
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

// ---- machine ------------------------------------------------------------------------------------------------
int64_t parse_size(std::string s) {
    while (!s.empty() && isspace((unsigned char) s.back())) s.pop_back();
    if (s.empty()) return 0;
    int64_t mul = 1;
    char    c   = s.back();
    if (c == 'K' || c == 'k') mul = 1 << 10;
    if (c == 'M' || c == 'm') mul = 1 << 20;
    if (c == 'G' || c == 'g') mul = 1LL << 30;
    if (mul != 1) s.pop_back();
    return atoll(s.c_str()) * mul;
}

static std::string read_file(const std::string & path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// as cpumoe_formats.machine.llc_bytes: the level-3 cache of cpu0, else the largest data/unified cache
int64_t llc_bytes() {
    int64_t l3 = 0, other = 0;
    for (int i = 0; i < 8; i++) {
        std::string d = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
        std::string type = read_file(d + "type");
        if (type.empty()) continue;
        if (type.rfind("Instruction", 0) == 0) continue;
        int     level = atoi(read_file(d + "level").c_str());
        int64_t size  = parse_size(read_file(d + "size"));
        if (level == 3) l3 = std::max(l3, size);
        other = std::max(other, size);
    }
    return l3 ? l3 : other;
}

std::string cpu_model() {
    if (FILE * p = popen("lscpu 2>/dev/null", "r")) {
        char        line[512];
        std::string model;
        while (fgets(line, sizeof line, p)) {
            if (strncmp(line, "Model name:", 11) == 0) {
                model = line + 11;
                break;
            }
        }
        pclose(p);
        size_t a = model.find_first_not_of(" \t");
        size_t b = model.find_last_not_of(" \t\n");
        if (a != std::string::npos) return model.substr(a, b - a + 1);
    }
    std::stringstream ss(read_file("/proc/cpuinfo"));
    std::string       line;
    while (std::getline(ss, line)) {
        if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
    }
    return "unknown";
}

std::string json_str(const std::string & s) {
    std::string o = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') { o += '\\'; o += c; }
        else if ((unsigned char) c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); o += b; }
        else o += c;
    }
    return o + "\"";
}

// ---- random data --------------------------------------------------------------------------------------------
static inline uint64_t splitmix64(uint64_t & x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
    z          = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z          = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// n normal floats (Box-Muller), scaled, from a stream seeded by (seed, tensor, expert): any expert can be
// regenerated bit-exactly for the reference check
void gen_normal(uint64_t seed, int tensor, int64_t expert, float scale, float * out, int64_t n) {
    uint64_t s = seed * 0x100000001B3ULL + (uint64_t) tensor * 0x9E3779B97F4A7C15ULL + (uint64_t) expert * 0xD1B54A32D192ED03ULL;
    splitmix64(s);
    const float two_pi = 6.28318530717958647692f;
    for (int64_t i = 0; i < n; i += 2) {
        uint64_t r  = splitmix64(s);
        float    u1 = ((r >> 40) + 1) * (1.0f / 16777217.0f);  // (0, 1]
        float    u2 = ((r >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
        float    m  = sqrtf(-2.0f * logf(u1)) * scale;
        out[i]      = m * cosf(two_pi * u2);
        if (i + 1 < n) out[i + 1] = m * sinf(two_pi * u2);
    }
}

// ---- routes -------------------------------------------------------------------------------------------------
// cpumoe_executor.bench.route_plans, step for step: plan j sends each token (random) or all tokens (shared) to
// top_k distinct experts of window j, by a partial Fisher-Yates shuffle driven by one splitmix64 stream per
// (seed, T, routing, w), so both sides read the same experts in every step
std::vector<std::vector<int32_t>> route_plans(uint64_t seed, int64_t n_plans, int64_t w, int T, int K, bool shared) {
    uint64_t s = seed * 0x100000001B3ULL + (uint64_t) T * 0x9E3779B97F4A7C15ULL + (shared ? 0xD1B54A32D192ED03ULL : 0) +
                 (uint64_t) w;
    std::vector<std::vector<int32_t>> plans(n_plans);
    std::vector<int32_t>              pool(w);
    for (int64_t j = 0; j < n_plans; j++) {
        plans[j].resize((size_t) K * T);
        for (int t = 0; t < (shared ? 1 : T); t++) {
            for (int64_t q = 0; q < w; q++) pool[q] = (int32_t) (j * w + q);
            for (int q = 0; q < K; q++) {
                const int64_t k = q + (int64_t) (splitmix64(s) % (uint64_t) (w - q));
                std::swap(pool[q], pool[k]);
                plans[j][(size_t) t * K + q] = pool[q];
            }
        }
        if (shared) {
            for (int t = 1; t < T; t++) std::copy_n(plans[j].data(), K, plans[j].data() + (size_t) t * K);
        }
    }
    return plans;
}

// cpumoe_executor.bench.routes_digest: FNV-1a 64 over the plans' ids in order
std::string routes_digest(const std::vector<std::vector<int32_t>> & plans) {
    uint64_t h = 0xCBF29CE484222325ULL;
    for (auto & p : plans) {
        for (int32_t v : p) h = (h ^ (uint32_t) v) * 0x100000001B3ULL;
    }
    char buf[20];
    snprintf(buf, sizeof buf, "%016llx", (unsigned long long) h);
    return buf;
}

// ---- timing -------------------------------------------------------------------------------------------------
Stats stats(std::vector<double> v) {
    Stats s;
    s.samples = v;
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    s.min    = v.front();
    s.max    = v.back();
    return s;
}
std::string json_stats(const Stats & s) {
    std::ostringstream o;
    o.precision(10);
    o << "{\"median\": " << s.median << ", \"min\": " << s.min << ", \"max\": " << s.max << ", \"samples\": [";
    for (size_t i = 0; i < s.samples.size(); i++) o << (i ? ", " : "") << s.samples[i];
    o << "]}";
    return o.str();
}

static volatile uint64_t g_sink;
void evict(std::vector<uint64_t> & buf) {  // read 4 x LLC (untimed), as ours reads its ceiling window
    uint64_t s = 0;
    for (size_t i = 0; i < buf.size(); i += 8) s += buf[i];
    g_sink = s;
}

