// The NaN/Inf check at module granularity (obs/features/dump/nan/check.py) at C++ speed.
//
// Check(owner...).on_module(module, args, output) is the global forward hook.  After a large kernel every Python
// attribute call on a tensor costs microseconds (cold caches); here a module's output costs none:
//   - an output that is one plain tensor (torch.Tensor, CPU, strided, contiguous, not a negative view, a floating
//     dtype) is checked here with the C statistics pass's gate (stats/_stats, through its capsule); anything else goes
//     to `slow` (NanCheck._on_module, which reads it in Python);
//   - the same memory (address, size, version, still alive) is read once: the last output checked, and the input
//     of a module of `preserving` (ReLU, MaxPool, ...) whose every argument was found finite this step;
//   - a non-finite output is handed to `report(module, args, output)`, which counts, dumps and may raise;
//   - with `backward`, a C++ gradient hook on the output gates the gradient reaching it, without the GIL; a
//     non-finite (or unreadable) gradient is handed to `grad_report(scope, op, grad)`.
// Gradient links (obs/features/dump/nan/_grad_links.py explains them): the output of a module whose backward preserves
// finiteness covers its input's watch; settle(roots), before a backward, walks the graph once and leaves a covered
// gradient unread when its one incoming edge comes from the covering module.  A backward without settle reads all.
//
// Built with torch.utils.cpp_extension against the installed torch (obs/features/dump/nan/native_check.py).
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

extern "C" {
#include "_stats_api.h"
}

namespace {

using torch::autograd::Node;
using WeakNode = c10::weak_intrusive_ptr<Node>;

const ObsStatsApi *g_api = nullptr;
PyObject *g_depth = nullptr, *g_stack = nullptr, *g_step = nullptr;  // attribute names
constexpr size_t kKnownMax = 4096;  // memories known finite in one step, at most

// The statistics pass's code of a tensor this file reads, else -1.
int readable(const at::Tensor &t) {
  if (!t.defined() || t.layout() != c10::kStrided || !t.device().is_cpu() || t.is_nested() || !t.has_storage() ||
      t.is_neg() || !t.is_contiguous())
    return -1;
  switch (t.scalar_type()) {
    case c10::ScalarType::Float: return F32;
    case c10::ScalarType::Double: return F64;
    case c10::ScalarType::Half: return F16;
    case c10::ScalarType::BFloat16: return BF16;
    default: return -1;
  }
}

struct Key {
  const void *address;
  int64_t numel, version;
  bool operator==(const Key &o) const { return address == o.address && numel == o.numel && version == o.version; }
};

struct KeyHash {
  size_t operator()(const Key &k) const {
    return std::hash<const void *>()(k.address) ^ (std::hash<int64_t>()(k.numel) * 31) ^
           (std::hash<int64_t>()(k.version) * 0x9e3779b97f4a7c15ull);
  }
};

Key key_of(const at::Tensor &t) {
  return Key{t.const_data_ptr(), static_cast<int64_t>(t.numel()),
             t.is_inference() ? -1 : static_cast<int64_t>(t._version())};
}

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl>;

WeakImpl weak_of(const at::Tensor &t) { return WeakImpl(t.getIntrusivePtr()); }
WeakImpl no_impl() { return WeakImpl(c10::intrusive_ptr<c10::TensorImpl>()); }
WeakNode no_node() { return WeakNode(c10::intrusive_ptr<Node>()); }

bool alive_as(const WeakImpl &weak, const at::Tensor &t) {
  auto strong = weak.lock();
  return strong.defined() && strong.get() == t.unsafeGetTensorImpl();
}

// What gradient hooks share with their Check: `grad_report` is borrowed, and read only with the GIL while enabled.
struct Shared {
  std::atomic<bool> enabled{true};
  std::atomic<long long> read{0};  // gradients gated here (the tests read it)
  PyObject *grad_report = nullptr;
};

enum { kCheck = 0, kPending = 1, kSkip = 2 };

struct Watch {
  std::shared_ptr<Shared> shared;
  std::string scope, op;
  std::atomic<int> state{kCheck};
  WeakNode node = no_node(), consumer = no_node();  // covered: the tensor's node and the one module that should use it
  uint32_t slot = 0;
};

struct State {
  long long step = -1;
  std::unordered_map<Key, WeakImpl, KeyHash> finite;  // memories found finite this step
  Key last{nullptr, 0, 0};
  WeakImpl last_impl = no_impl();
  std::unordered_map<const c10::TensorImpl *, std::pair<WeakImpl, std::shared_ptr<Watch>>> watches;
  std::vector<std::shared_ptr<Watch>> covered;

  void new_step(long long number) {
    step = number;
    finite.clear();
    watches.clear();
    covered.clear();
    last_impl = no_impl();
  }
};

void on_gradient(Watch &watch, const at::Tensor &grad) {
  if (!watch.shared->enabled.load(std::memory_order_relaxed) || watch.state.load() == kSkip || !grad.defined())
    return;
  const int code = readable(grad);
  if (code >= 0) {
    watch.shared->read.fetch_add(1, std::memory_order_relaxed);
    if (g_api->finite(grad.const_data_ptr(), static_cast<Py_ssize_t>(grad.numel()), code)) return;
  }
  pybind11::gil_scoped_acquire gil;
  if (!watch.shared->enabled.load()) return;
  PyObject *scope = PyUnicode_DecodeUTF8(watch.scope.data(), static_cast<Py_ssize_t>(watch.scope.size()), "replace");
  PyObject *op = PyUnicode_DecodeUTF8(watch.op.data(), static_cast<Py_ssize_t>(watch.op.size()), "replace");
  PyObject *value = THPVariable_Wrap(grad);
  PyObject *done = nullptr;
  if (scope != nullptr && op != nullptr && value != nullptr) {
    PyObject *args[] = {scope, op, value};
    done = PyObject_Vectorcall(watch.shared->grad_report, args, 3, nullptr);
  }
  Py_XDECREF(scope);
  Py_XDECREF(op);
  Py_XDECREF(value);
  if (done == nullptr) {  // raise mode: the error reaches the user through autograd
    python_error error;
    error.persist();
    throw error;
  }
  Py_DECREF(done);
}

#define REFS(X) X(suppression) X(tracker) X(preserving) X(elementwise) X(pools) X(pool_preserves) X(slow) X(report) \
  X(grad_report)

struct CheckObject {
  PyObject_HEAD
  PyObject *suppression, *tracker, *preserving, *elementwise, *pools, *pool_preserves, *slow, *report, *grad_report;
  int backward, enabled;
  long long reported_step, outputs_read;
  std::shared_ptr<Shared> *shared;
  State *state;
};

// Whether every item of `args` is a plain tensor found finite this step (and there is one).
bool all_known_finite(CheckObject *self, PyObject *args) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) == 0) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
    PyObject *item = PyTuple_GET_ITEM(args, i);
    if (!THPVariable_CheckExact(item)) return false;
    const at::Tensor &t = THPVariable_Unpack(item);
    if (!t.defined()) return false;
    auto found = self->state->finite.find(key_of(t));
    if (found == self->state->finite.end() || !found->second.lock().defined()) return false;
  }
  return true;
}

// Whether `module`'s backward makes a finite input gradient from every finite output gradient; -1 on error.
int preserves_in_backward(CheckObject *self, PyObject *module) {
  PyObject *kind = reinterpret_cast<PyObject *>(Py_TYPE(module));
  int found = PySet_Contains(self->elementwise, kind);
  if (found != 0) return found;
  found = PySet_Contains(self->pools, kind);
  if (found <= 0) return found;
  PyObject *answer = PyObject_CallOneArg(self->pool_preserves, module);
  if (answer == nullptr) return -1;
  found = PyObject_IsTrue(answer);
  Py_DECREF(answer);
  return found;
}

bool has_python_hooks(PyObject *tensor) {
  PyObject *hooks = reinterpret_cast<THPVariable *>(tensor)->backward_hooks;
  return hooks != nullptr && hooks != Py_None && (!PyDict_Check(hooks) || PyDict_GET_SIZE(hooks) > 0);
}

// `output`'s watch covers the watch of `args`' one tensor, pending settle (see the file's comment).
void cover(CheckObject *self, PyObject *args, PyObject *output, const at::Tensor &y) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 1) return;
  PyObject *item = PyTuple_GET_ITEM(args, 0);
  if (!THPVariable_CheckExact(item) || has_python_hooks(item) || has_python_hooks(output)) return;
  const at::Tensor &x = THPVariable_Unpack(item);
  auto &watches = self->state->watches;
  auto found = watches.find(x.unsafeGetTensorImpl());
  if (found == watches.end() || !alive_as(found->second.first, x)) return;
  Watch &watch = *found->second.second;
  const auto node = x.grad_fn(), consumer = y.grad_fn();
  if (watch.state.load() != kCheck || watch.node.lock().defined() || !node || !consumer ||
      x.const_data_ptr() == y.const_data_ptr())
    return;  // covered already, a leaf, or in place
  watch.node = WeakNode(node);
  watch.consumer = WeakNode(consumer);
  watch.slot = x.output_nr();
  watch.state.store(kPending);
  self->state->covered.push_back(found->second.second);
}

PyObject *on_module(CheckObject *self, PyObject *const *argv, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "on_module(module, args, output) takes 3 arguments");
    return nullptr;
  }
  PyObject *module = argv[0], *args = argv[1], *output = argv[2];
  if (!self->enabled) Py_RETURN_NONE;
  PyObject *depth = PyObject_GetAttr(self->suppression, g_depth);
  if (depth == nullptr) return nullptr;
  const int busy = PyObject_IsTrue(depth);
  Py_DECREF(depth);
  if (busy) return busy < 0 ? nullptr : Py_NewRef(Py_None);
  PyObject *step_obj = PyObject_GetAttr(self->tracker, g_step);
  if (step_obj == nullptr) return nullptr;
  const long long step = PyLong_AsLongLong(step_obj);
  Py_DECREF(step_obj);
  if (step == -1 && PyErr_Occurred()) return nullptr;
  if (step == self->reported_step) Py_RETURN_NONE;
  int code = -1;
  if (THPVariable_CheckExact(output)) code = readable(THPVariable_Unpack(output));
  if (code < 0) return PyObject_Vectorcall(self->slow, argv, 3, nullptr);
  State &state = *self->state;
  if (state.step != step) state.new_step(step);
  const at::Tensor &y = THPVariable_Unpack(output);
  const Key key = key_of(y);
  // A container's output, a flatten: the same elements, while the last tensor checked lives (else its memory
  // could hold another tensor at the same address).
  if (key == state.last && state.last_impl.lock().defined()) Py_RETURN_NONE;
  state.last = key;
  state.last_impl = weak_of(y);
  int derived = PySet_Contains(self->preserving, reinterpret_cast<PyObject *>(Py_TYPE(module)));
  if (derived < 0) return nullptr;
  if (!(derived && all_known_finite(self, args))) {
    self->outputs_read++;
    if (!g_api->finite(y.const_data_ptr(), static_cast<Py_ssize_t>(y.numel()), code))
      return PyObject_Vectorcall(self->report, argv, 3, nullptr);
  }
  if (state.finite.size() < kKnownMax) state.finite.insert_or_assign(key, weak_of(y));
  if (!self->backward || !y.requires_grad()) Py_RETURN_NONE;
  auto watch = std::make_shared<Watch>();
  watch->shared = *self->shared;
  watch->op = _PyType_Name(Py_TYPE(module));
  PyObject *stack = PyObject_GetAttr(self->suppression, g_stack);
  if (stack == nullptr) return nullptr;
  if (PyList_Check(stack) && PyList_GET_SIZE(stack) > 0) {
    Py_ssize_t size = 0;
    const char *text = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1), &size);
    if (text == nullptr) {
      Py_DECREF(stack);
      return nullptr;
    }
    watch->scope.assign(text, static_cast<size_t>(size));
  } else {
    watch->scope = watch->op;
  }
  Py_DECREF(stack);
  y.register_hook([watch](const at::Tensor &grad) { on_gradient(*watch, grad); });
  state.watches.insert_or_assign(y.unsafeGetTensorImpl(), std::make_pair(weak_of(y), watch));
  const int preserves = preserves_in_backward(self, module);
  if (preserves < 0) return nullptr;
  if (preserves) cover(self, args, output, y);
  Py_RETURN_NONE;
}

// Before a backward from `roots` (a tensor or a sequence of tensors): settle each covered watch (file comment).
PyObject *settle(CheckObject *self, PyObject *roots) {
  auto &covered = self->state->covered;
  if (covered.empty()) Py_RETURN_NONE;
  std::vector<Node *> stack;
  auto add_root = [&stack](PyObject *value) {
    if (THPVariable_Check(value)) {
      const auto &root = THPVariable_Unpack(value);
      if (root.defined() && root.grad_fn()) stack.push_back(root.grad_fn().get());
    }
  };
  if (THPVariable_Check(roots)) {
    add_root(roots);
  } else {
    PyObject *seq = PySequence_Fast(roots, "settle: roots must be a tensor or a sequence of tensors");
    if (seq == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) add_root(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
  }
  struct SlotHash {
    size_t operator()(const std::pair<const Node *, uint32_t> &s) const {
      return std::hash<const Node *>()(s.first) ^ s.second;
    }
  };
  std::unordered_map<std::pair<const Node *, uint32_t>, int, SlotHash> edges;
  std::vector<c10::intrusive_ptr<Node>> alive;  // the covered nodes, kept alive while they are compared
  for (auto &watch : covered) {
    auto node = watch->node.lock();
    if (node) {
      edges[{node.get(), watch->slot}] = 0;
      alive.push_back(std::move(node));
    }
  }
  std::unordered_set<const Node *> seen;
  while (!stack.empty()) {
    Node *node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto &edge : node->next_edges()) {
      if (!edge.function) continue;
      auto found = edges.find({edge.function.get(), edge.input_nr});
      if (found != edges.end()) found->second++;
      stack.push_back(edge.function.get());
    }
  }
  for (auto &watch : covered) {
    auto node = watch->node.lock();
    if (!node) continue;  // its graph is gone: its hook cannot run
    auto consumer = watch->consumer.lock();
    const int count = edges[{node.get(), watch->slot}];
    const bool only_consumer = count == 1 && consumer && seen.count(consumer.get()) > 0;
    watch->state.store(count == 0 || only_consumer ? kSkip : kCheck);
  }
  Py_RETURN_NONE;
}

// A C++ exception (torch's checks) becomes a Python one: nothing unwinds through the interpreter.
template <typename F>
PyObject *guarded(F &&body) {
  try {
    return body();
  } catch (python_error &error) {
    error.restore();
    return nullptr;
  } catch (const std::exception &error) {
    PyErr_Format(PyExc_RuntimeError, "obs NaN/Inf check: %s", error.what());
    return nullptr;
  }
}

PyObject *Check_on_module(CheckObject *self, PyObject *const *argv, Py_ssize_t nargs) {
  return guarded([&] { return on_module(self, argv, nargs); });
}

PyObject *Check_settle(CheckObject *self, PyObject *roots) {
  return guarded([&] { return settle(self, roots); });
}

int Check_init(CheckObject *self, PyObject *args, PyObject *kwargs) {
  static const char *names[] = {"suppression", "tracker", "preserving", "elementwise", "pools", "pool_preserves",
                                "slow", "report", "grad_report", "backward", nullptr};
  PyObject *refs[9];
  int backward = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!O!O!OOOO|p", const_cast<char **>(names), &refs[0], &refs[1],
                                   &PyFrozenSet_Type, &refs[2], &PyFrozenSet_Type, &refs[3], &PyFrozenSet_Type,
                                   &refs[4], &refs[5], &refs[6], &refs[7], &refs[8], &backward))
    return -1;
  int i = 0;
#define SET(name) Py_XSETREF(self->name, Py_NewRef(refs[i++]));
  REFS(SET)
#undef SET
  self->backward = backward;
  self->enabled = 1;
  self->reported_step = -1;
  if (self->state == nullptr) self->state = new State();
  if (self->shared != nullptr) (*self->shared)->enabled.store(false);  // hooks of an earlier init stay inert
  delete self->shared;
  self->shared = new std::shared_ptr<Shared>(std::make_shared<Shared>());
  (*self->shared)->grad_report = self->grad_report;
  return 0;
}

void disable(CheckObject *self) {
  self->enabled = 0;
  if (self->shared != nullptr) (*self->shared)->enabled.store(false);
}

int Check_traverse(CheckObject *self, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(self->name);
  REFS(VISIT)
#undef VISIT
  return 0;
}

int Check_clear_refs(CheckObject *self) {
  disable(self);
#define CLEAR(name) Py_CLEAR(self->name);
  REFS(CLEAR)
#undef CLEAR
  return 0;
}

void Check_dealloc(CheckObject *self) {
  PyObject_GC_UnTrack(self);
  Check_clear_refs(self);
  delete self->shared;
  delete self->state;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

PyObject *Check_disable(CheckObject *self, PyObject *) {
  disable(self);
  Py_RETURN_NONE;
}

PyObject *Check_get_reported_step(CheckObject *self, void *) { return PyLong_FromLongLong(self->reported_step); }

int Check_set_reported_step(CheckObject *self, PyObject *value, void *) {
  const long long step = value == nullptr ? -1 : PyLong_AsLongLong(value);
  if (step == -1 && PyErr_Occurred()) return -1;
  self->reported_step = step;
  return 0;
}

PyObject *Check_get_gradients_read(CheckObject *self, void *) {
  return PyLong_FromLongLong(self->shared == nullptr ? 0 : (*self->shared)->read.load());
}

PyObject *Check_get_outputs_read(CheckObject *self, void *) { return PyLong_FromLongLong(self->outputs_read); }

PyGetSetDef check_getset[] = {
    {"outputs_read", reinterpret_cast<getter>(Check_get_outputs_read), nullptr,
     "module outputs this check read (not those handed to slow)", nullptr},
    {"gradients_read", reinterpret_cast<getter>(Check_get_gradients_read), nullptr,
     "gradients this check's hooks read (not those handed to grad_report)", nullptr},
    {"reported_step", reinterpret_cast<getter>(Check_get_reported_step),
     reinterpret_cast<setter>(Check_set_reported_step), "the step whose finding was reported (no more checks)",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef check_methods[] = {
    {"on_module", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Check_on_module)), METH_FASTCALL,
     "on_module(module, args, output): the global forward hook"},
    {"settle", reinterpret_cast<PyCFunction>(Check_settle), METH_O,
     "settle(roots): before a backward from roots, which covered gradients stay unread"},
    {"disable", reinterpret_cast<PyCFunction>(Check_disable), METH_NOARGS,
     "check nothing more (gradient hooks already registered stay inert)"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject CheckType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "obs_dump_nan", "the NaN/Inf check's module hook at C++ speed", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_obs_dump_nan(void) {
  g_api = obs_stats_api_import("the NaN/Inf check");
  if (g_api == nullptr) return nullptr;
  CheckType.tp_name = "obs_dump_nan.Check";
  CheckType.tp_basicsize = sizeof(CheckObject);
  CheckType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  CheckType.tp_doc = "Check(suppression, tracker, preserving, elementwise, pools, pool_preserves, slow, report, "
                     "grad_report, backward=True)";
  CheckType.tp_new = PyType_GenericNew;
  CheckType.tp_init = reinterpret_cast<initproc>(Check_init);
  CheckType.tp_dealloc = reinterpret_cast<destructor>(Check_dealloc);
  CheckType.tp_traverse = reinterpret_cast<traverseproc>(Check_traverse);
  CheckType.tp_clear = reinterpret_cast<inquiry>(Check_clear_refs);
  CheckType.tp_methods = check_methods;
  CheckType.tp_getset = check_getset;
  if (PyType_Ready(&CheckType) < 0) return nullptr;
  g_depth = PyUnicode_InternFromString("depth");
  g_stack = PyUnicode_InternFromString("stack");
  g_step = PyUnicode_InternFromString("step");
  if (g_depth == nullptr || g_stack == nullptr || g_step == nullptr) return nullptr;
  PyObject *m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&CheckType);
  if (PyModule_AddObject(m, "Check", reinterpret_cast<PyObject *>(&CheckType)) < 0) {
    Py_DECREF(&CheckType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
