// The native op recorder: a RecordFunction observer (the mechanism torch.profiler and Kineto use)
// that writes OP slots into the recorder's ring without Python and without the GIL.
//
// Built against the installed torch by recorder/native_ops.py (torch.utils.cpp_extension), loaded
// with ctypes.  It shares the ring's counters, string table and per-thread scope stack with the C
// hot path (recorder/_shared.c) through the addresses Python hands to obs_ops_attach, so its slots
// are the Python handlers' slots: a = op name id, b = scope id, c = duration, d = inputs id, t =
// end time (CLOCK_MONOTONIC, as time.perf_counter_ns).  flags: bit 0 the op raised, bit 1 it ran
// inside another op, bits 4-15 the recording thread's number (1 = the first thread seen).
//
// No lock and no GIL on the way: the caches are thread-local; a miss (a new op name or a new
// signature, a few hundred per run) takes a mutex and appends to the string table, whose own mutex
// is never held while waiting for the GIL.  It must be compiled with -DNDEBUG like libtorch itself:
// RecordFunction's layout depends on it.
#include <ATen/record_function.h>

#include <pthread.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>

namespace {

#pragma pack(push, 1)
struct Slot {
  uint64_t seq, idx;
  int64_t t;
  uint16_t kind, flags;
  int32_t a;
  int64_t b, c, d;
};
#pragma pack(pop)
static_assert(sizeof(Slot) == 56, "slot layout must match recorder.layout.SLOT");

constexpr uint16_t kKindOp = 5, kFlagError = 1, kFlagNested = 2;
using AppendFn = int32_t (*)(void *, const char *, uint32_t);
using ScopeFn = int32_t (*)();

struct Target {
  char *base = nullptr;
  uint64_t capacity = 0;
  uint64_t *idx = nullptr, *seq = nullptr;
  void *table = nullptr;
  AppendFn append = nullptr;
  ScopeFn scope = nullptr;
  bool inputs = false;
};

Target g_target;
std::atomic<bool> g_active{false};
std::atomic<int> g_inflight{0};
std::atomic<uint64_t> g_generation{0}, g_recorded{0};
std::atomic<uint16_t> g_threads{0};
at::CallbackHandle g_handle = 0;
std::mutex g_mutex;  // guards the shared caches below and attach/detach
std::unordered_map<uint64_t, int32_t> g_names, g_signatures;
std::unordered_map<std::string, int32_t> g_texts;  // one id per text: ops share their signatures' texts

struct ThreadCache {
  uint64_t generation = UINT64_MAX;
  std::unordered_map<uint64_t, int32_t> names, signatures;
  uint16_t number = 0;
  int depth = 0;
};
thread_local ThreadCache t_cache;

struct Context : at::ObserverContext {
  int64_t start;
  int32_t name, scope;
  int64_t inputs;
  int uncaught;
  bool nested;

  // One per op: recycled through a free list of the thread that frees it, not malloc and free each time.
  static void *operator new(std::size_t size);
  static void operator delete(void *p);
};

thread_local void *t_free_contexts = nullptr;  // a trivial thread_local: no initialisation guard per access

void *Context::operator new(std::size_t size) {
  if (void *p = t_free_contexts) {
    t_free_contexts = *static_cast<void **>(p);
    return p;
  }
  return ::operator new(size);
}

void Context::operator delete(void *p) {
  *static_cast<void **>(p) = t_free_contexts;
  t_free_contexts = p;
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ULL; }

ThreadCache &cache() {
  ThreadCache &c = t_cache;
  uint64_t generation = g_generation.load(std::memory_order_acquire);
  if (c.generation != generation) {  // a new ring: its string ids are not the old ones
    c.names.clear();
    c.signatures.clear();
    c.generation = generation;
  }
  if (c.number == 0) {
    uint16_t n = g_threads.fetch_add(1, std::memory_order_relaxed) + 1;
    c.number = n > 4095 ? 4095 : n;
  }
  return c;
}

// The id of `text` for `key`, from the shared cache or appended to the ring's string table.
int32_t intern(std::unordered_map<uint64_t, int32_t> &shared, uint64_t key, const std::string &text) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = shared.find(key);
  if (it != shared.end()) return it->second;
  auto known = g_texts.find(text);
  int32_t id = known != g_texts.end() ? known->second
                                      : g_target.append(g_target.table, text.data(), static_cast<uint32_t>(text.size()));
  if (id >= 0) {
    shared.emplace(key, id);
    g_texts.emplace(text, id);
  }
  return id;
}

// An operator as the dispatch mode names it (aten::add, overload Tensor -> add.Tensor); other records
// (autograd::engine::evaluate_function: AddmmBackward0, user record_function ranges) as they are.
std::string op_name(const at::RecordFunction &fn) {
  auto op = fn.operator_name();
  if (!op) return fn.name();
  std::string name = op->name;
  auto pos = name.find("::");
  if (pos != std::string::npos) name.erase(0, pos + 2);
  if (!op->overload_name.empty() && op->overload_name != "default") name += "." + op->overload_name;
  return name;
}

const char *dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    case c10::ScalarType::ComplexFloat: return "complex64";
    case c10::ScalarType::ComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

const char *kind_name(const c10::IValue &v) {
  if (v.isNone()) return "NoneType";
  if (v.isInt()) return "int";
  if (v.isDouble()) return "float";
  if (v.isBool()) return "bool";
  if (v.isString()) return "str";
  if (v.isList() || v.isIntList() || v.isTensorList() || v.isDoubleList() || v.isBoolList()) return "list";
  if (v.isDevice()) return "device";
  if (v.isScalar()) return "Number";
  return "object";
}

// "float32[64, 784]@cpu float32[784, 256]@cpu int", as recorder.ring_handlers.describe_args writes it.
std::string describe(c10::ArrayRef<const c10::IValue> inputs) {
  std::string out;
  for (const auto &v : inputs) {
    if (!out.empty()) out += ' ';
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor &t = v.toTensor();
      out += dtype_name(t.scalar_type());
      out += '[';
      bool first = true;
      for (auto s : t.sizes()) {
        if (!first) out += ", ";
        out += std::to_string(s);
        first = false;
      }
      out += "]@";
      out += t.device().str();
    } else {
      out += kind_name(v);
    }
  }
  return out;
}

// Name and overload, by their text alone: a record named by a string (autograd::engine::evaluate_function:
// AddmmBackward0) holds its own copy of it, so a key with the pointer in it missed on every call and
// re-interned the name into the ring's string table each time.
uint64_t name_key(const at::RecordFunction &fn) {
  std::hash<std::string_view> hash;
  return mix(hash(fn.name()), hash(fn.overload_name()));
}

uint64_t signature_key(uint64_t h, c10::ArrayRef<const c10::IValue> inputs) {
  for (const auto &v : inputs) {
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor &t = v.toTensor();
      h = mix(h, 0x7e50 + t.dim());
      for (auto s : t.sizes()) h = mix(h, static_cast<uint64_t>(s));
      h = mix(h, static_cast<uint64_t>(t.scalar_type()));
      h = mix(h, (static_cast<uint64_t>(t.device().type()) << 8) | static_cast<uint8_t>(t.device().index()));
    } else {
      h = mix(h, reinterpret_cast<uintptr_t>(kind_name(v)));  // one static string per kind
    }
  }
  return h;
}

// Counts a callback in flight, so detach can wait until none touches the ring or its table.
struct InFlight {
  InFlight() { g_inflight.fetch_add(1, std::memory_order_acquire); }
  ~InFlight() { g_inflight.fetch_sub(1, std::memory_order_release); }
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction &fn) {
  InFlight busy;
  if (!g_active.load(std::memory_order_acquire)) return nullptr;
  ThreadCache &c = cache();
  auto ctx = std::make_unique<Context>();
  uint64_t key = name_key(fn);
  auto it = c.names.find(key);
  if (it == c.names.end()) it = c.names.emplace(key, intern(g_names, key, op_name(fn))).first;
  ctx->name = it->second;
  ctx->scope = g_target.scope();
  ctx->inputs = 0;
  if (g_target.inputs && fn.needsInputs()) {
    auto inputs = fn.inputs();
    uint64_t sig = signature_key(key, inputs);
    auto s = c.signatures.find(sig);
    if (s == c.signatures.end()) s = c.signatures.emplace(sig, intern(g_signatures, sig, describe(inputs))).first;
    ctx->inputs = s->second;
  }
  ctx->nested = c.depth++ > 0;
  ctx->uncaught = std::uncaught_exceptions();
  ctx->start = now_ns();
  return ctx;
}

void on_end(const at::RecordFunction &, at::ObserverContext *raw) {
  if (raw == nullptr) return;
  auto *ctx = static_cast<Context *>(raw);
  int64_t end = now_ns();
  ThreadCache &c = t_cache;
  if (c.depth > 0) c.depth--;
  InFlight busy;
  if (g_active.load(std::memory_order_acquire)) {
    uint16_t flags = static_cast<uint16_t>(c.number << 4);
    if (ctx->nested) flags |= kFlagNested;
    if (std::uncaught_exceptions() > ctx->uncaught) flags |= kFlagError;  // unwinding: the op raised
    Slot slot;
    uint64_t idx = __atomic_fetch_add(g_target.idx, 1, __ATOMIC_RELAXED);
    slot.seq = __atomic_fetch_add(g_target.seq, 1, __ATOMIC_RELAXED);
    slot.idx = idx + 1;
    slot.t = end;
    slot.kind = kKindOp;
    slot.flags = flags;
    slot.a = ctx->name;
    slot.b = ctx->scope;
    slot.c = end - ctx->start;
    slot.d = ctx->inputs;
    std::memcpy(g_target.base + (idx % g_target.capacity) * sizeof(Slot), &slot, sizeof(Slot));
    g_recorded.fetch_add(1, std::memory_order_relaxed);
  }
}

void after_fork_in_child() {
  // The child (a DataLoader worker, say) shares the parent's ring mapping but not its counters:
  // it must never write there.  The callback stays registered (removing it here is not safe).
  g_active.store(false);
}

}  // namespace

extern "C" {

// Start recording ops into the ring region at `base` (`capacity` slots).  0 on success, -1 when
// already attached.
int obs_ops_attach(char *base, uint64_t capacity, uint64_t *idx, uint64_t *seq, void *table, AppendFn append,
                   ScopeFn scope, int inputs) {
  static std::once_flag fork_hook;
  std::call_once(fork_hook, [] { pthread_atfork(nullptr, nullptr, after_fork_in_child); });
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_handle != 0 || capacity == 0) return -1;
  g_target = Target{base, capacity, idx, seq, table, append, scope, inputs != 0};
  g_names.clear();
  g_signatures.clear();
  g_texts.clear();
  g_generation.fetch_add(1, std::memory_order_release);
  g_active.store(true, std::memory_order_release);
  g_handle = at::addGlobalCallback(
      at::RecordFunctionCallback(on_start, on_end).needsInputs(inputs != 0).scopes({at::RecordScope::FUNCTION}));
  return 0;
}

// Stop recording; returns once no callback is writing into the ring any more.
void obs_ops_detach() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_active.store(false, std::memory_order_release);
    if (g_handle != 0) {
      at::removeCallback(g_handle);
      g_handle = 0;
    }
  }
  while (g_inflight.load(std::memory_order_acquire) != 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

uint64_t obs_ops_recorded() { return g_recorded.load(std::memory_order_relaxed); }

}  // extern "C"
