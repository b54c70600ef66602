// statistic.csv's rows at C++ speed: the per-tensor half of statistic_csv.py (beside it) for plain CPU tensors.
//
// Rows(rows, picks, zeros, slow).add_values(op, io, values) does what StatisticRows.add_values does in
// Python (each_tensor + add), reading tensors through ATen instead of a dozen Python attribute calls:
//   - slots follow positions; a list or tuple of tensors (or None) takes one slot per item;
//   - a plain Tensor or Parameter on the CPU, strided, dense (contiguous, or a permutation of consecutive
//     slots: read in memory order, as the Python path reads it), not a negative view, of a dtype the
//     C pass knows, gets its record here: [values, dtype, shape, None], the values from the C pass (_stats)
//     (through its capsule: one implementation of the statistics);
//   - records are shared by memory within a step, as in Python: the same live storage, address,
//     shape, strides, dtype and version hold the same values (inference tensors have no version: not
//     shared);
//   - anything else is handed to `slow(op, io, slot, tensor)` (StatisticRows._add), in order.
// Rows are kept here, not as Python objects (Step), and text(header, whole, dtypes) formats statistic.csv with
// the C pass's (_stats) number formatting; the Python path's rows, appended by `slow` to the caller's list, keep their
// place among them.  clear() forgets the step's rows and records.
//
// After name_ops(...), on_op(name, args, kwargs, output) is DataDump._on_op (obs/features/dump/data_dump.py) for
// an OP_OUTPUT subscriber without a Python frame per op: while `active`, it names the op
// (`{scope}/{Kind}-op{n}`; backward ops under Gradients/ and their forward module), appends its
// execution-order line, stamps it and records the rows of its inputs and outputs.  Whatever is done once
// per op type or full name (escaping, the kernels filter) stays in Python, called on a cache miss.
// enter(scope, module) / leave(scope, module, error) are its MODULE_ENTER / MODULE_EXIT subscribers: they keep
// the autograd sequence numbers of each module call (obs/features/dump/_autograd_scopes.py's intervals, here in
// C++), which name a backward op's forward module, and call on_root(module) at the root module's first call while
// `parameters_pending` (the step's Parameter rows).
//
// Built with torch.utils.cpp_extension against the installed torch (native_rows.py).
#include <Python.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

extern "C" {
#include "_stats_api.h"
}

namespace {

const ObsStatsApi *g_api = nullptr;
PyObject *g_input = nullptr, *g_output = nullptr;  // "input", "output": the rows' io
PyObject *g_stack = nullptr;                       // "stack": the scope stack's attribute name
constexpr int kMaxDims = 8;  // a tensor of more dimensions is not shared (computed each time it is seen)
constexpr int kMaxPicks = OBS_STATS_MAX_PICKS;

int code_of(c10::ScalarType type) {  // obs/features/dump/stats/_stats.c's dtype codes
  switch (type) {
    case c10::ScalarType::Float: return F32;
    case c10::ScalarType::Double: return F64;
    case c10::ScalarType::Half: return F16;
    case c10::ScalarType::BFloat16: return BF16;
    case c10::ScalarType::Long: return I64;
    case c10::ScalarType::Int: return I32;
    case c10::ScalarType::Short: return I16;
    case c10::ScalarType::Char: return I8;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool: return U8;
    default: return -1;
  }
}

struct Key {
  const void *address;
  int64_t version;
  int dtype, dims;
  std::array<int64_t, 2 * kMaxDims> layout;  // sizes, then strides

  bool operator==(const Key &o) const {
    return address == o.address && version == o.version && dtype == o.dtype && dims == o.dims &&
           std::memcmp(layout.data(), o.layout.data(), sizeof(int64_t) * 2 * dims) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key &k) const {
    size_t h = std::hash<const void *>()(k.address) ^ (std::hash<int64_t>()(k.version) * 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < 2 * k.dims; i++) h = h * 31 + std::hash<int64_t>()(k.layout[i]);
    return h ^ static_cast<size_t>(k.dtype);
  }
};

// A row's op: its type and escaped name (strong references to str) and its microseconds.
struct OpRef {
  PyObject *kind, *name;
  long long stamp;
};

// One tensor's statistics (npicks of Step::values from values_at), dtype and shape (dims of Step::sizes from sizes_at).
struct Record {
  c10::ScalarType type;
  uint32_t values_at, sizes_at, dims;
};

// A row: an op's input or output slot and its record; a negative record is the Python recorder's row -1 - record of
// the caller's list (a tensor handed to `slow`), so that rows stay in order.
struct Row {
  int32_t op, slot, record;
  bool output;
};

struct Shared {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int32_t record;
};

// One step's rows, kept in C++: a Python tuple, list, floats and shape per row were about 1,000 objects made and freed
// a step.  text() formats them; clear() forgets them.
struct Step {
  uint64_t generation = 0;                          // clear() counts: an op begun before one adds no rows after it
  std::unordered_map<Key, Shared, KeyHash> memory;  // the records shared by memory
  std::vector<OpRef> ops;
  std::vector<Record> records;
  std::vector<ObsValue> values;
  std::vector<int64_t> sizes;
  std::vector<Row> rows;

  void clear() {
    generation++;
    memory.clear();
    std::vector<OpRef> old;
    old.swap(ops);
    for (auto &op : old) {
      Py_DECREF(op.kind);
      Py_DECREF(op.name);
    }
    records.clear();
    values.clear();
    sizes.clear();
    rows.clear();
  }
};

// Module calls as autograd sequence-number intervals [start, end), kept in exit order (ModuleSpans in Python).
struct Spans {
  static constexpr size_t kKept = 1 << 14;
  std::vector<uint64_t> starts, ends;
  std::vector<std::pair<uint64_t, PyObject *>> spans;  // (start, scope: a strong reference) beside their ends

  void trim(size_t count) {
    for (size_t i = 0; i < count; i++) Py_DECREF(spans[i].second);
    ends.erase(ends.begin(), ends.begin() + static_cast<std::ptrdiff_t>(count));
    spans.erase(spans.begin(), spans.begin() + static_cast<std::ptrdiff_t>(count));
  }

  // The scope of the innermost module call whose interval holds `nr` (borrowed), else nullptr.
  PyObject *scope_of(uint64_t nr) const {
    for (size_t i = std::upper_bound(ends.begin(), ends.end(), nr) - ends.begin(); i < spans.size(); i++)
      if (spans[i].first <= nr) return spans[i].second;
    return nullptr;
  }
};

// Each op position's last (scope, kind, name entry), so that a step running the same ops in the same modules reuses
// the entry without formatting and hashing the full name again; and each forward module's "Gradients/" scope.
// Every pointer is a strong reference: an address compared is never a freed object's.
struct Names {
  static constexpr size_t kMaxPositions = 1 << 20, kMaxGradients = 1 << 14;
  struct Position {
    PyObject *scope = nullptr, *kind = nullptr, *entry = nullptr;
  };
  std::vector<Position> positions;
  std::unordered_map<PyObject *, PyObject *> gradients;  // module scope → "Gradients/{scope}"

  void clear_gradients() {
    for (auto &item : gradients) {
      Py_DECREF(item.first);
      Py_DECREF(item.second);
    }
    gradients.clear();
  }
  void clear() {
    for (auto &p : positions) {
      Py_XDECREF(p.scope);
      Py_XDECREF(p.kind);
      Py_XDECREF(p.entry);
    }
    positions.clear();
    clear_gradients();
  }
  // The entry last seen at position n for this scope and kind (borrowed), else nullptr.
  PyObject *at(size_t n, PyObject *scope, PyObject *kind) const {
    return n < positions.size() && positions[n].scope == scope && positions[n].kind == kind ? positions[n].entry
                                                                                              : nullptr;
  }
  void keep(size_t n, PyObject *scope, PyObject *kind, PyObject *entry) {
    if (n >= kMaxPositions) return;
    if (n >= positions.size()) positions.resize(n + 1);
    Position &p = positions[n];
    Py_XSETREF(p.scope, Py_NewRef(scope));
    Py_XSETREF(p.kind, Py_NewRef(kind));
    Py_XSETREF(p.entry, Py_NewRef(entry));
  }
};

// The object's Python references, for GC traversal and clearing
#define REFS(X)                                                                                                \
  X(rows) X(slow) X(types) X(new_kind) X(names) X(name_entry) X(order) X(on_root) X(suppression) X(uninitialised)

struct RowsObject {
  PyObject_HEAD
  PyObject *rows;  // the caller's list
  PyObject *slow;  // StatisticRows.add
  int zeros;
  int picks[kMaxPicks];
  Py_ssize_t npicks;
  Step *step;
  // on_op's state (name_ops): see DataDump for what each is
  PyObject *types, *new_kind, *names, *name_entry, *order, *on_root, *suppression, *uninitialised;
  int active, inputs, outputs, parameters_pending;
  Spans *spans;
  Names *known;
  Py_ssize_t count;
  long long last_stamp;
};

void forget(RowsObject *self) {
  if (self->step != nullptr) self->step->clear();
}

// A new record of t (its index in the step): the statistics from the C pass (_stats, through its capsule: one
// implementation of them), read with the GIL released for a large buffer, so the step is only touched after.
int32_t new_record(RowsObject *self, const at::Tensor &t, int code) {
  ObsValue values[kMaxPicks];
  g_api->compute(t.const_data_ptr(), static_cast<Py_ssize_t>(t.numel()), code, self->zeros, 1, self->picks,
                 self->npicks, values);
  Step &step = *self->step;
  const auto sizes = t.sizes();
  const Record record{t.scalar_type(), static_cast<uint32_t>(step.values.size()),
                      static_cast<uint32_t>(step.sizes.size()), static_cast<uint32_t>(sizes.size())};
  step.values.insert(step.values.end(), values, values + self->npicks);
  step.sizes.insert(step.sizes.end(), sizes.begin(), sizes.end());
  step.records.push_back(record);  // last: a record never points past its values and sizes
  return static_cast<int32_t>(step.records.size() - 1);
}

// The record of a tensor this file handles (its index), shared with another tensor over the same memory.
int32_t record_of(RowsObject *self, const at::Tensor &t, int code) {
  const int dims = static_cast<int>(t.dim());
  if (t.is_inference() || dims > kMaxDims) return new_record(self, t, code);
  Key key{t.const_data_ptr(), static_cast<int64_t>(t._version()), static_cast<int>(t.scalar_type()),
          dims, {}};
  const auto sizes = t.sizes(), strides = t.strides();
  for (int i = 0; i < dims; i++) {
    key.layout[i] = sizes[i];
    key.layout[dims + i] = strides[i];
  }
  c10::StorageImpl *storage = t.storage().unsafeGetStorageImpl();
  auto &memory = self->step->memory;
  auto found = memory.find(key);
  if (found != memory.end()) {
    if (found->second.storage.lock().get() == storage) return found->second.record;
    memory.erase(found);  // another storage at a freed address: replaced below
  }
  const int32_t record = new_record(self, t, code);
  self->step->memory.insert_or_assign(key, Shared{t.storage().getWeakStorageImpl(), record});
  return record;
}

// Whether t's elements exactly fill numel consecutive slots from its data pointer in some order (a transpose, a
// permutation, channels-last): the pass reads them in memory order, as stats._dense lets the Python path do.
bool dense(const at::Tensor &t) {
  if (t.is_contiguous()) return true;
  std::array<std::pair<int64_t, int64_t>, kMaxDims> dims;  // (stride, size) of each dimension of size > 1
  size_t n = 0;
  const auto sizes = t.sizes(), strides = t.strides();
  if (sizes.size() > kMaxDims) return false;
  for (size_t i = 0; i < sizes.size(); i++)
    if (sizes[i] > 1) dims[n++] = {strides[i], sizes[i]};
  std::sort(dims.begin(), dims.begin() + static_cast<std::ptrdiff_t>(n));
  int64_t expected = 1;
  for (size_t i = 0; i < n; i++) {
    if (dims[i].first != expected) return false;
    expected *= dims[i].second;
  }
  return true;
}

// A new reference released at the end of its scope (a C++ exception included).
struct Held {
  PyObject *object;
  explicit Held(PyObject *o) : object(o) {}
  Held(const Held &) = delete;
  Held &operator=(const Held &) = delete;
  ~Held() { Py_XDECREF(object); }
};

// The op whose rows are being added: it is pushed onto the step (its index there), and keeps its own (type, name,
// µs) for the tuple the slow path is given, made when first needed unless the caller gave one.  Its rows are kept only
// while the step is the one it began in (a buffer is read with the GIL released: another thread may clear the step).
struct OpCtx {
  int32_t index = -1;
  uint64_t generation;
  PyObject *kind = nullptr, *name = nullptr, *tuple;
  long long stamp;
  bool owned = false;
  OpCtx(Step &step, PyObject *k, PyObject *n, long long s, PyObject *given)
      : generation(step.generation), tuple(given), stamp(s) {
    step.ops.push_back(OpRef{k, n, s});  // may throw: nothing is referenced yet
    Py_INCREF(k);  // the step's
    Py_INCREF(n);
    kind = Py_NewRef(k);
    name = Py_NewRef(n);
    index = static_cast<int32_t>(step.ops.size() - 1);
  }
  OpCtx(const OpCtx &) = delete;
  OpCtx &operator=(const OpCtx &) = delete;
  ~OpCtx() {
    if (owned) Py_XDECREF(tuple);
    Py_XDECREF(kind);
    Py_XDECREF(name);
  }
  bool current(const Step &step) const { return step.generation == generation; }
  PyObject *python() {
    if (tuple == nullptr) {
      tuple = Py_BuildValue("(OOL)", kind, name, stamp);
      owned = tuple != nullptr;
    }
    return tuple;
  }
};

// One row: here for the tensors this file reads, else through `slow`, whose row is appended here (so that another
// thread's cannot land in between).  -1 with an exception on failure.
int add_held(RowsObject *self, OpCtx &op, bool output, Py_ssize_t slot, PyObject *value) {
  int code = -1;
  const at::Tensor *t = nullptr;
  if (THPVariable_CheckExact(value)) {
    t = &THPVariable_Unpack(value);
    if (t->defined() && t->layout() == c10::kStrided && t->device().is_cpu() && !t->is_nested() && t->has_storage() &&
        !t->is_neg() && dense(*t))
      code = code_of(t->scalar_type());
  }
  if (code < 0) {
    PyObject *tuple = op.python();
    PyObject *index = tuple == nullptr ? nullptr : PyLong_FromSsize_t(slot);
    if (index == nullptr) return -1;
    PyObject *args[] = {tuple, output ? g_output : g_input, index, value};
    Held row(PyObject_Vectorcall(self->slow, args, 4, nullptr));
    Py_DECREF(index);
    if (row.object == nullptr) return -1;
    if (row.object == Py_None || !op.current(*self->step)) return 0;
    if (PyList_Append(self->rows, row.object) < 0) return -1;
    const Py_ssize_t at = PyList_GET_SIZE(self->rows) - 1;
    self->step->rows.push_back(Row{op.index, static_cast<int32_t>(slot), static_cast<int32_t>(-1 - at), output});
    return 0;
  }
  const int32_t record = record_of(self, *t, code);
  if (op.current(*self->step)) self->step->rows.push_back(Row{op.index, static_cast<int32_t>(slot), record, output});
  return 0;
}

int add_one(RowsObject *self, OpCtx &op, bool output, Py_ssize_t slot, PyObject *value) {
  Held held(Py_NewRef(value));  // borrowed from a list another thread may change while a buffer is read
  return add_held(self, op, output, slot, value);
}

// Whether `value` is a tensor.  The ints, floats, bools and Nones among an op's arguments are told apart by their
// exact type first: THPVariable_Check on them is an isinstance through torch.Tensor's metaclass (~450 instructions).
inline bool is_tensor(PyObject *value) {
  if (THPVariable_CheckExact(value)) return true;
  if (value == Py_None || PyLong_CheckExact(value) || PyFloat_CheckExact(value) || PyBool_Check(value)) return false;
  return THPVariable_Check(value);
}

// Whether `value` is a non-empty list or tuple of tensors and Nones (one slot per item); -1 on error.
int tensor_list(PyObject *value) {
  if (!(PyList_Check(value) || PyTuple_Check(value)) || PySequence_Fast_GET_SIZE(value) == 0) return 0;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(value, i);
    if (item != Py_None && !is_tensor(item)) return 0;
  }
  return 1;
}

int add_all(RowsObject *self, OpCtx &op, bool output, PyObject *values) {
  PyObject *seq = PySequence_Fast(values, "add_values: values must be a sequence");
  if (seq == nullptr) return -1;
  Py_ssize_t slot = 0;
  int rc = 0;
  for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(seq); i++) {
    PyObject *value = PySequence_Fast_GET_ITEM(seq, i);
    if (is_tensor(value)) {
      rc = add_one(self, op, output, slot++, value);
      continue;
    }
    int list = tensor_list(value);
    if (list <= 0) {
      rc = list;
      slot++;
      continue;
    }
    Py_INCREF(value);  // a list may change under the slow path's Python code
    for (Py_ssize_t j = 0; rc == 0 && j < PySequence_Fast_GET_SIZE(value); j++, slot++) {
      PyObject *item = PySequence_Fast_GET_ITEM(value, j);
      if (item != Py_None) rc = add_one(self, op, output, slot, item);
    }
    Py_DECREF(value);
  }
  Py_DECREF(seq);
  return rc;
}

PyObject *Rows_add_values(RowsObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "add_values(op, io, values) takes 3 arguments");
    return nullptr;
  }
  if (self->rows == nullptr || self->step == nullptr) {
    PyErr_SetString(PyExc_TypeError, "Rows.__init__(rows, picks, zeros, slow) was not called");
    return nullptr;
  }
  PyObject *op = args[0];
  const int output = PyUnicode_Check(args[1]) ? PyUnicode_CompareWithASCIIString(args[1], "output") == 0 : -1;
  if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 3 || !PyUnicode_Check(PyTuple_GET_ITEM(op, 0)) ||
      !PyUnicode_Check(PyTuple_GET_ITEM(op, 1)) || (output == 0 && PyUnicode_CompareWithASCIIString(args[1], "input")) ||
      output < 0) {
    PyErr_SetString(PyExc_TypeError, "add_values: op is (type: str, name: str, stamp: int), io 'input' or 'output'");
    return nullptr;
  }
  const long long stamp = PyLong_AsLongLong(PyTuple_GET_ITEM(op, 2));
  if (stamp == -1 && PyErr_Occurred()) return nullptr;
  try {
    OpCtx ctx(*self->step, PyTuple_GET_ITEM(op, 0), PyTuple_GET_ITEM(op, 1), stamp, op);
    if (add_all(self, ctx, output == 1, args[2]) < 0) return nullptr;
  } catch (const std::exception &e) {  // an ATen error, or python_error from an isinstance check
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// ---- text: statistic.csv from the step's rows -------------------------------------------------------

void put_utf8(std::string &out, PyObject *text) {  // text: a str (checked where it was kept)
  Py_ssize_t n;
  const char *data = PyUnicode_AsUTF8AndSize(text, &n);
  if (data == nullptr) throw std::runtime_error("statistic.csv: a name is not UTF-8");
  out.append(data, static_cast<size_t>(n));
}

void put_int(std::string &out, long long v) {
  char text[OBS_STATS_TEXT_MAX];
  const ObsValue value{OBS_INT, 0.0, v};
  out.append(text, static_cast<size_t>(g_api->value_text(&value, 0, text)));
}

// "{size},{dtype},\"({shape})\",{statistics}": the columns after the slot (the Python formatter's _format).
void put_record(std::string &out, const Step &step, const Record &record, const int *whole, Py_ssize_t npicks) {
  const auto *dtype = reinterpret_cast<THPDtype *>(torch::getTHPDtype(record.type));
  const int64_t *sizes = step.sizes.data() + record.sizes_at;
  long long size = static_cast<long long>(c10::elementSize(record.type));
  for (uint32_t i = 0; i < record.dims; i++) size *= sizes[i];
  put_int(out, size);
  out += ',';
  out += dtype->name;  // "float32": str(torch.float32) without "torch."
  out += ",\"(";
  for (uint32_t i = 0; i < record.dims; i++) {
    if (i) out += ',';
    put_int(out, sizes[i]);
  }
  out += ")\"";
  const bool floating = c10::isFloatingType(record.type) || c10::isComplexType(record.type);
  char text[OBS_STATS_TEXT_MAX];
  for (Py_ssize_t i = 0; i < npicks; i++) {
    out += ',';
    const int n = g_api->value_text(&step.values[record.values_at + i], !floating && whole[i], text);
    out.append(text, static_cast<size_t>(n));
  }
}

// text(header, whole, dtypes): statistic.csv, the header then one line per row in order.  Each record is formatted
// once; the Python recorder's rows through the C pass's (_stats) formatter (whole, dtypes: as format_rows takes them).
PyObject *Rows_text(RowsObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyUnicode_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "text(header: str, whole: list, dtypes: dict)");
    return nullptr;
  }
  if (self->step == nullptr || self->rows == nullptr) {
    PyErr_SetString(PyExc_TypeError, "Rows.__init__(rows, picks, zeros, slow) was not called");
    return nullptr;
  }
  int whole[kMaxPicks] = {0};
  for (Py_ssize_t i = 0; i < self->npicks && i < PyList_GET_SIZE(args[1]); i++)
    if ((whole[i] = PyObject_IsTrue(PyList_GET_ITEM(args[1], i))) < 0) return nullptr;
  const Step &step = *self->step;
  const uint64_t generation = step.generation;
  try {
    std::string out;
    out.reserve(4096 + 96 * step.rows.size());
    put_utf8(out, args[0]);
    out += '\n';
    std::vector<std::pair<size_t, size_t>> texts(step.records.size(), {0, 0});  // each record's text in `out`
    int32_t last_op = -1;
    size_t prefix_at = 0, prefix_len = 0;
    for (size_t r = 0; r < step.rows.size(); r++) {  // by index: a Python row's formatting may run Python code
      const Row row = step.rows[r];
      if (row.op < 0 || static_cast<size_t>(row.op) >= step.ops.size()) continue;  // cleared while it was added
      if (row.record < 0) {
        const Py_ssize_t at = -1 - static_cast<Py_ssize_t>(row.record);
        if (at >= PyList_GET_SIZE(self->rows)) continue;
        Held python_row(Py_NewRef(PyList_GET_ITEM(self->rows, at)));
        Held line(g_api->row_line(python_row.object, args[1], args[2]));
        if (line.object == nullptr) return nullptr;
        if (step.generation != generation) {  // its formatting ran Python code that cleared the step
          PyErr_SetString(PyExc_RuntimeError, "statistic rows: the step was cleared while its text was made");
          return nullptr;
        }
        put_utf8(out, line.object);
        last_op = -1;
        continue;
      }
      if (static_cast<size_t>(row.record) >= texts.size() || static_cast<size_t>(row.record) >= step.records.size())
        continue;
      if (row.op == last_op) {  // an op's rows follow one another: copy its prefix
        out.append(out, prefix_at, prefix_len);
      } else {
        const OpRef &op = step.ops[static_cast<size_t>(row.op)];
        last_op = row.op;
        prefix_at = out.size();
        put_utf8(out, op.kind);
        out += ',';
        put_utf8(out, op.name);
        out += ",0,0,";
        put_int(out, op.stamp);
        out += ',';
        prefix_len = out.size() - prefix_at;
      }
      out += row.output ? "output," : "input,";
      put_int(out, row.slot);
      out += ',';
      auto &text = texts[static_cast<size_t>(row.record)];
      if (text.second) {
        out.append(out, text.first, text.second);
      } else {
        text.first = out.size();
        put_record(out, step, step.records[static_cast<size_t>(row.record)], whole, self->npicks);
        text.second = out.size() - text.first;
      }
      out += '\n';
    }
    return PyUnicode_DecodeUTF8(out.data(), static_cast<Py_ssize_t>(out.size()), "strict");
  } catch (const std::exception &e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject *Rows_get_size(RowsObject *self, void *) {
  return PyLong_FromSize_t(self->step == nullptr ? 0 : self->step->rows.size());
}

PyObject *Rows_clear(RowsObject *self, PyObject *) {
  forget(self);
  Py_RETURN_NONE;
}

int Rows_init(RowsObject *self, PyObject *args, PyObject *kwargs) {
  PyObject *rows, *picks, *slow;
  int zeros;
  static const char *names[] = {"rows", "picks", "zeros", "slow", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!pO:Rows", const_cast<char **>(names), &PyList_Type, &rows,
                                   &PyTuple_Type, &picks, &zeros, &slow))
    return -1;
  if (PyTuple_GET_SIZE(picks) > kMaxPicks || !PyCallable_Check(slow)) {
    PyErr_SetString(PyExc_ValueError, "Rows: at most 32 picks, and a callable slow path");
    return -1;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(picks); i++) {
    long pick = PyLong_AsLong(PyTuple_GET_ITEM(picks, i));
    if (pick == -1 && PyErr_Occurred()) return -1;
    self->picks[i] = static_cast<int>(pick);
  }
  self->npicks = PyTuple_GET_SIZE(picks);
  self->zeros = zeros;
  Py_XSETREF(self->rows, Py_NewRef(rows));
  Py_XSETREF(self->slow, Py_NewRef(slow));
  if (self->step == nullptr) self->step = new Step();
  if (self->spans == nullptr) self->spans = new Spans();
  if (self->known == nullptr) self->known = new Names();
  forget(self);
  return 0;
}

int Rows_traverse(RowsObject *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
  REFS(VISIT)  // slow: a bound method of the StatisticRows that holds this object, a cycle
#undef VISIT
  return 0;  // the step's ops hold only str

}

int Rows_clear_refs(RowsObject *self) {
  forget(self);
  if (self->spans != nullptr) {
    self->spans->trim(self->spans->spans.size());
    self->spans->starts.clear();
  }
  if (self->known != nullptr) self->known->clear();
#define CLEAR(f) Py_CLEAR(self->f);
  REFS(CLEAR)
#undef CLEAR
  return 0;
}

void Rows_dealloc(RowsObject *self) {
  PyObject_GC_UnTrack(self);
  Rows_clear_refs(self);
  delete self->step;
  delete self->spans;
  delete self->known;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}


// ---- on_op: DataDump._on_op without a Python frame ------------------------------------------------

long long next_stamp(RowsObject *self) {  // microseconds, increasing: one per op, shared with Python's stamps
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  long long now = static_cast<long long>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
  self->last_stamp = now > self->last_stamp ? now : self->last_stamp + 1;
  return self->last_stamp;
}

// A new reference to d[key], else to miss(key) (which fills d); NULL with an exception.
PyObject *cached(PyObject *d, PyObject *key, PyObject *miss) {
  PyObject *found = PyDict_GetItemWithError(d, key);
  if (found != nullptr) return Py_NewRef(found);
  if (PyErr_Occurred()) return nullptr;
  return PyObject_CallOneArg(miss, key);
}

// The op's scope: Gradients/{forward module} in backward, else the innermost module in flight (new reference).
PyObject *scope_of(RowsObject *self) {
  const auto node = torch::autograd::get_current_node();
  if (node) {
    PyObject *module = self->spans->scope_of(node->sequence_nr());
    if (module == nullptr || !PyUnicode_GET_LENGTH(module)) return PyUnicode_FromString("Gradients/Default");
    auto &gradients = self->known->gradients;
    auto found = gradients.find(module);
    if (found != gradients.end()) return Py_NewRef(found->second);
    PyObject *scope = PyUnicode_FromFormat("Gradients/%U", module);
    if (scope == nullptr) return nullptr;
    if (gradients.size() >= Names::kMaxGradients) self->known->clear_gradients();
    gradients.emplace(Py_NewRef(module), Py_NewRef(scope));
    return scope;
  }
  PyObject *stack = PyObject_GetAttr(self->suppression, g_stack);
  if (stack == nullptr) return nullptr;
  Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : 0;
  PyObject *scope = depth ? Py_NewRef(PyList_GET_ITEM(stack, depth - 1)) : PyUnicode_FromString("Default");
  Py_DECREF(stack);
  return scope;
}

int record_op(RowsObject *self, PyObject *name, PyObject *kind, PyObject *const *args) {
  PyObject *scope = scope_of(self);
  if (scope == nullptr) return -1;
  const Py_ssize_t n = self->count++;
  PyObject *entry = self->known->at(static_cast<size_t>(n), scope, kind);  // (order line, escaped name, dumped)
  if (entry != nullptr) {
    Py_INCREF(entry);
  } else {
    PyObject *full = PyUnicode_FromFormat("%U/%U-op%zd", scope, kind, n);
    entry = full == nullptr ? nullptr : cached(self->names, full, self->name_entry);
    Py_XDECREF(full);
    if (entry != nullptr) self->known->keep(static_cast<size_t>(n), scope, kind, entry);
  }
  Py_DECREF(scope);
  if (entry == nullptr) return -1;
  int rc = -1, wanted = 0;
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
    PyErr_SetString(PyExc_TypeError, "on_op: a name entry is (order line, escaped name, dumped)");
  } else if (PyList_Append(self->order, PyTuple_GET_ITEM(entry, 0)) == 0 &&
             (wanted = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 2))) >= 0) {
    rc = 0;
  }
  if (rc < 0 || !wanted) {
    Py_DECREF(entry);
    return rc;
  }
  Held held(entry);
  PyObject *escaped = PyTuple_GET_ITEM(entry, 1);
  if (!PyUnicode_Check(escaped)) {
    PyErr_SetString(PyExc_TypeError, "on_op: a name entry's escaped name is a str");
    return -1;
  }
  OpCtx op(*self->step, kind, escaped, next_stamp(self), nullptr);
  if (self->inputs) {  // positional arguments, then keyword arguments' values
    PyObject *kw = args[2], *values;
    if (PyDict_Check(kw) && PyDict_GET_SIZE(kw)) {
      values = PySequence_List(args[1]);
      PyObject *extra = values == nullptr ? nullptr : PyDict_Values(kw);
      if (extra == nullptr || PyList_SetSlice(values, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, extra) < 0) Py_CLEAR(values);
      Py_XDECREF(extra);
    } else {
      values = Py_NewRef(args[1]);
    }
    Held held_values(values);  // released if add_all throws too
    rc = values == nullptr ? -1 : add_all(self, op, false, values);
  }
  if (rc == 0 && self->outputs) {
    int garbage = 0;  // the name starts with one of `uninitialised`
    for (Py_ssize_t i = 0; garbage == 0 && i < PyTuple_GET_SIZE(self->uninitialised); i++)
      garbage = static_cast<int>(PyUnicode_Tailmatch(name, PyTuple_GET_ITEM(self->uninitialised, i), 0,
                                                     PY_SSIZE_T_MAX, -1));
    if (garbage < 0) {
      rc = -1;
    } else if (!garbage) {  // outputs of ops that return uninitialised memory are not dumped
      PyObject *output = args[3];
      PyObject *items = PyList_Check(output) || PyTuple_Check(output) ? Py_NewRef(output) : PyTuple_Pack(1, output);
      PyObject *wrapped = items == nullptr ? nullptr : PyTuple_Pack(1, items);
      Py_XDECREF(items);
      Held held_wrapped(wrapped);
      rc = wrapped == nullptr ? -1 : add_all(self, op, true, wrapped);
    }
  }
  return rc;
}

PyObject *Rows_on_op(RowsObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "on_op(name, args, kwargs, output) takes 4 arguments");
    return nullptr;
  }
  if (!self->active) Py_RETURN_NONE;
  if (self->types == nullptr || self->rows == nullptr || self->step == nullptr) {
    PyErr_SetString(PyExc_TypeError, "on_op: Rows.__init__ and name_ops were not called");
    return nullptr;
  }
  PyObject *kind = cached(self->types, args[0], self->new_kind);  // "" for what is not a computation
  if (kind == nullptr) return nullptr;
  int rc = 0;
  try {
    if (PyUnicode_Check(kind) && PyUnicode_GET_LENGTH(kind)) rc = record_op(self, args[0], kind, args);
  } catch (const std::exception &e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
    rc = -1;
  }
  Py_DECREF(kind);
  if (rc < 0) return nullptr;
  Py_RETURN_NONE;
}

// MODULE_ENTER: the call's first sequence number; the root's first call in a dumped step: on_root(module).
PyObject *Rows_enter(RowsObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "enter(scope, module) takes 2 arguments");
    return nullptr;
  }
  if (self->spans == nullptr || self->suppression == nullptr) {
    PyErr_SetString(PyExc_TypeError, "enter: Rows.__init__ and name_ops were not called");
    return nullptr;
  }
  self->spans->starts.push_back(at::sequence_number::peek());
  if (!self->active || !self->parameters_pending) Py_RETURN_NONE;
  PyObject *stack = PyObject_GetAttr(self->suppression, g_stack);
  if (stack == nullptr) return nullptr;
  const bool root = PyList_Check(stack) && PyList_GET_SIZE(stack) == 1;
  Py_DECREF(stack);
  if (!root) Py_RETURN_NONE;
  self->parameters_pending = 0;
  return PyObject_CallOneArg(self->on_root, args[1]);
}

// MODULE_EXIT: the call's interval, kept in exit order (another thread's numbers are clamped to keep it sorted).
PyObject *Rows_leave(RowsObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "leave(scope, module, error) takes 3 arguments");
    return nullptr;
  }
  if (self->spans == nullptr || self->spans->starts.empty()) Py_RETURN_NONE;
  Spans &spans = *self->spans;
  uint64_t end = at::sequence_number::peek();
  if (!spans.ends.empty() && end < spans.ends.back()) end = spans.ends.back();
  spans.ends.push_back(end);
  spans.spans.emplace_back(spans.starts.back(), Py_NewRef(args[0]));
  spans.starts.pop_back();
  if (spans.ends.size() > 2 * Spans::kKept) spans.trim(Spans::kKept);
  Py_RETURN_NONE;
}

PyObject *Rows_name_ops(RowsObject *self, PyObject *args, PyObject *kwargs) {
  static const char *names[] = {"types", "new_kind", "names", "name_entry", "order", "on_root", "suppression",
                                "uninitialised", "inputs", "outputs", nullptr};
  PyObject *state[8];
  int inputs, outputs;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OO!OO!OOO!pp:name_ops", const_cast<char **>(names),
                                   &PyDict_Type, &state[0], &state[1], &PyDict_Type, &state[2], &state[3],
                                   &PyList_Type, &state[4], &state[5], &state[6], &PyTuple_Type, &state[7],
                                   &inputs, &outputs))
    return nullptr;
  PyObject **fields[] = {&self->types, &self->new_kind, &self->names, &self->name_entry, &self->order,
                         &self->on_root, &self->suppression, &self->uninitialised};
  for (int i = 0; i < 8; i++) Py_XSETREF(*fields[i], Py_NewRef(state[i]));
  self->inputs = inputs;
  self->outputs = outputs;
  Py_RETURN_NONE;
}

PyObject *Rows_stamp(RowsObject *self, PyObject *) { return PyLong_FromLongLong(next_stamp(self)); }

PyObject *Rows_get_count(RowsObject *self, void *) { return PyLong_FromSsize_t(self->count); }

int Rows_set_count(RowsObject *self, PyObject *value, void *) {
  Py_ssize_t count = value == nullptr ? -1 : PyLong_AsSsize_t(value);
  if (count < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "count: a non-negative int");
    return -1;
  }
  self->count = count;
  return 0;
}

PyObject *Rows_get_active(RowsObject *self, void *) { return PyBool_FromLong(self->active); }

// Sets a flag from a Python truth value; -1 with an exception (ValueError when deleted).
int set_flag(int *flag, PyObject *value, const char *name) {
  const int truth = value == nullptr ? -1 : PyObject_IsTrue(value);
  if (truth < 0) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: a bool", name);
    return -1;
  }
  *flag = truth;
  return 0;
}

int Rows_set_active(RowsObject *self, PyObject *value, void *) { return set_flag(&self->active, value, "active"); }

PyObject *Rows_get_parameters_pending(RowsObject *self, void *) { return PyBool_FromLong(self->parameters_pending); }

int Rows_set_parameters_pending(RowsObject *self, PyObject *value, void *) {
  return set_flag(&self->parameters_pending, value, "parameters_pending");
}

PyGetSetDef rows_getset[] = {
    {"parameters_pending", reinterpret_cast<getter>(Rows_get_parameters_pending),
     reinterpret_cast<setter>(Rows_set_parameters_pending), "whether enter calls on_root at the root's next call",
     nullptr},
    {"count", reinterpret_cast<getter>(Rows_get_count), reinterpret_cast<setter>(Rows_set_count),
     "ops named in this step", nullptr},
    {"active", reinterpret_cast<getter>(Rows_get_active), reinterpret_cast<setter>(Rows_set_active),
     "whether on_op records (a selected step)", nullptr},
    {"size", reinterpret_cast<getter>(Rows_get_size), nullptr, "the step's rows", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef rows_methods[] = {
    {"add_values", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Rows_add_values)), METH_FASTCALL,
     "add_values(op, io, values): the rows of the tensors in values (slots follow positions)"},
    {"clear", reinterpret_cast<PyCFunction>(Rows_clear), METH_NOARGS, "forget the step's rows and records"},
    {"text", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Rows_text)), METH_FASTCALL,
     "text(header, whole, dtypes): statistic.csv of the step's rows"},
    {"on_op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Rows_on_op)), METH_FASTCALL,
     "on_op(name, args, kwargs, output): DataDump._on_op (after name_ops)"},
    {"name_ops", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Rows_name_ops)),
     METH_VARARGS | METH_KEYWORDS, "name_ops(types, new_kind, names, name_entry, order, on_root, suppression, "
     "uninitialised, inputs, outputs): what on_op and enter read"},
    {"enter", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Rows_enter)), METH_FASTCALL,
     "enter(scope, module): a MODULE_ENTER subscriber (module intervals; on_root)"},
    {"leave", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Rows_leave)), METH_FASTCALL,
     "leave(scope, module, error): a MODULE_EXIT subscriber (module intervals)"},
    {"stamp", reinterpret_cast<PyCFunction>(Rows_stamp), METH_NOARGS, "the next op's microseconds (increasing)"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject RowsType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "obs_dump_rows", "statistic.csv's rows at C++ speed", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_obs_dump_rows(void) {
  g_api = obs_stats_api_import("the statistic recorder");
  if (g_api == nullptr) return nullptr;
  RowsType.tp_name = "obs_dump_rows.Rows";
  RowsType.tp_basicsize = sizeof(RowsObject);
  RowsType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  RowsType.tp_doc = "Rows(rows, picks, zeros, slow): statistic rows appended to `rows`";
  RowsType.tp_new = PyType_GenericNew;
  RowsType.tp_init = reinterpret_cast<initproc>(Rows_init);
  RowsType.tp_dealloc = reinterpret_cast<destructor>(Rows_dealloc);
  RowsType.tp_traverse = reinterpret_cast<traverseproc>(Rows_traverse);
  RowsType.tp_clear = reinterpret_cast<inquiry>(Rows_clear_refs);
  RowsType.tp_methods = rows_methods;
  RowsType.tp_getset = rows_getset;
  if (PyType_Ready(&RowsType) < 0) return nullptr;
  g_input = PyUnicode_InternFromString("input");
  g_output = PyUnicode_InternFromString("output");
  g_stack = PyUnicode_InternFromString("stack");
  if (g_input == nullptr || g_output == nullptr || g_stack == nullptr) return nullptr;
  PyObject *m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&RowsType);
  if (PyModule_AddObject(m, "Rows", reinterpret_cast<PyObject *>(&RowsType)) < 0) {
    Py_DECREF(&RowsType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
