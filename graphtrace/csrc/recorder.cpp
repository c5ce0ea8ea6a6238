// The recorder's per-op path in C++: the same rows as graphtrace.recorder.PyWriter, faster.
//
// A Writer serves one capture. For every op it appends one record (seq, code, slot: the
// layout of graphtrace/encoding.py) per tensor to buffers that flush() moves into the
// Capture's arrays. It shares the
// trace's tables with the Python writer: storages are registered in one native Table (a weak
// handle per storage, exactly what UntypedStorage._weak_ref() makes; Python's StorageTable
// registers there too) and views are interned by the trace's Interner, so both writers give
// the same ids for the same storage and view.
// Whatever this file does not handle (tensor subclasses, dicts, symbolic shapes, tensors
// without storage) goes to the Python writer for that op, after rolling back and flushing.
//
// Everything runs under the GIL and calls no Python code while it changes the shared tables,
// so captures on two threads never interleave inside one registration.
//
// Storages are held by weak handle and swept as registration goes: why, and what it means for
// identity, is docs/internals.md, Note [weak handles and the sweep].

#include <Python.h>

#include <c10/core/StorageImpl.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// The record encoding, defined once here with the values of graphtrace/encoding.py (the
// extension exports them under encoding.py's names; tests/test_native.py compares them).
constexpr int64_t kRead = 0, kWrite = 1, kView = 2, kFactory = 3;  // access
constexpr int kAccessBits = 2;                                      // code = arg << bits | access
constexpr int64_t kAccessMask = (int64_t(1) << kAccessBits) - 1;
constexpr int kSidShift = 32;                                       // slot = sid << shift | view
constexpr size_t kAccessFields = 3;                                 // int64s per record
constexpr int kReplayWrote = 1, kReplayFresh = 2;                   // what record() returns

int64_t code_access(int64_t code) { return code & kAccessMask; }
int64_t with_access(int64_t code, int64_t access) { return (code & ~kAccessMask) | access; }
int64_t pack_slot(int64_t sid, int64_t view) { return (sid << kSidShift) | view; }
int64_t slot_storage(int64_t slot) { return slot >> kSidShift; }

struct PythonError {};  // a Python exception is set
struct Fallback {};     // this op goes to the Python writer

PyObject* check(PyObject* obj) {
  if (obj == nullptr) throw PythonError();
  return obj;
}

// An owned reference, released on scope exit.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* obj) : p(check(obj)) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

int64_t as_int(PyObject* obj) {
  int64_t v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) throw PythonError();
  return v;
}

int64_t optional_code(PyObject* obj) {  // None -> -1
  return obj == Py_None ? -1 : as_int(obj);
}

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

using KeyMap = ska::flat_hash_map<std::vector<int64_t>, int64_t, KeyHash>;

// The tensor one argument position of one op got last, and its slot. Repeated calls of one
// op with the same tensors (a compiled region's inputs: parameters, call after call) skip both
// hash lookups: the memo holds when the tensor has the same StorageImpl and view key, and the
// table still holds that storage under the memo's id (`handle(sid)` is the StorageImpl's
// address until the sweep releases it, and a held handle keeps the address from being reused).
struct ArgMemo {
  static constexpr size_t kMaxKey = 3 + 2 * 6;  // views of up to 6 dimensions
  const void* impl = nullptr;
  int64_t slot = 0;
  size_t n = 0;  // key length; 0: empty
  int64_t key[kMaxKey];
};

struct Plan {
  int64_t op_id = 0;
  std::vector<int64_t> positional;  // row code per positional argument, -1: no tensor
  PyObject* by_keyword = nullptr;   // dict: argument name -> row code (owned)
  std::vector<int64_t> returns;     // code with access 0 per return slot, -1: a mutated argument
  bool may_alias = false;
  bool opaque = false;     // ScriptObject arguments: the whole op goes to the Python writer
  std::vector<ArgMemo> memo;  // per positional argument (this writer's: one capture)
};

bool is_scalar(PyObject* v) {
  return v == Py_None || PyLong_CheckExact(v) || PyFloat_CheckExact(v) || PyBool_Check(v) ||
      PyUnicode_CheckExact(v);
}

bool is_exact_tensor(PyObject* v) {
  return Py_TYPE(v) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
}

// Every storage a trace has seen: one weak handle each (what UntypedStorage._weak_ref()
// returns: it keeps the StorageImpl, so its address, unique, never its data). Shared by the
// trace's writers; Python's StorageTable reads its columns through since().
class Table {
 public:
  ~Table() { release(); }

  int64_t find(const void* impl) const {
    auto it = index_.find(impl);
    return it == index_.end() ? -1 : it->second;
  }

  // `impl` must be alive (the caller holds a tensor or storage on it).
  int64_t add(c10::StorageImpl* impl) {
    auto it = index_.find(impl);
    if (it != index_.end()) return it->second;
    const int64_t nb = static_cast<int64_t>(impl->nbytes());  // throws for symbolic sizes
    const auto device = impl->device();
    const int64_t dkey = static_cast<int64_t>(device.type()) * 65536 + device.index() + 1;
    auto d = device_ids_.find(dkey);
    if (d == device_ids_.end()) {
      d = device_ids_.emplace(dkey, static_cast<int32_t>(device_names_.size())).first;
      device_names_.push_back(device.str());
    }
    const int64_t sid = static_cast<int64_t>(handles_.size());
    void* handle = c10::raw::intrusive_ptr::make_weak(impl);
    handles_.push_back(reinterpret_cast<int64_t>(handle));
    data_ptrs_.push_back(reinterpret_cast<int64_t>(impl->data_ptr().get()));
    nbytes_.push_back(nb);
    devices_.push_back(d->second);
    index_.emplace(impl, sid);
    if (sweeping && handles_.size() >= swept_ + kSweepLag + kSweepBatch) {
      sweep(swept_, handles_.size() - kSweepLag);
      swept_ = handles_.size() - kSweepLag;
    }
    return sid;
  }

  // Release the handles of storages in [from, to) that are dead.
  void sweep(size_t from, size_t to) {
    if (!sweeping) return;
    to = std::min(to, handles_.size());
    for (size_t sid = from; sid < to; ++sid) {
      const int64_t h = handles_[sid];
      if (h == 0) continue;
      auto* impl = reinterpret_cast<c10::StorageImpl*>(h);
      if (c10::raw::weak_intrusive_ptr::use_count(impl) != 0) continue;
      index_.erase(impl);
      c10::raw::weak_intrusive_ptr::decref(impl);
      handles_[sid] = 0;
      ++released_;
    }
  }

  size_t size() const { return handles_.size(); }
  uint64_t released() const { return released_; }

  // The weak handle of storage `sid` (0: released, dead); -1 when out of range.
  int64_t handle(int64_t sid) const {
    if (sid < 0 || static_cast<size_t>(sid) >= handles_.size()) return -1;
    return handles_[sid];
  }

  bool alive(int64_t sid) const {
    const int64_t h = handle(sid);
    return h > 0 &&
        c10::raw::weak_intrusive_ptr::use_count(reinterpret_cast<c10::StorageImpl*>(h)) != 0;
  }

  // Heap bytes of the containers (malloc's 16 B per block counted; tracemalloc can't see
  // them). The maps are open-addressing (ska::flat_hash_map): a slot per bucket, a distance
  // byte and the entry padded to 8 bytes.
  size_t memory() const {
    constexpr size_t kMalloc = 16;
    size_t n = (handles_.capacity() + data_ptrs_.capacity() + nbytes_.capacity()) * 8 +
        devices_.capacity() * 4;
    n += (index_.bucket_count() + 1) * (8 + sizeof(std::pair<const void*, int64_t>)) + kMalloc;
    n += (views.bucket_count() + 1) * (8 + sizeof(std::pair<std::vector<int64_t>, int64_t>)) +
        kMalloc;
    for (const auto& kv : views) n += kv.first.capacity() * 8 + kMalloc;
    return n;
  }

  // (dtype, offset, ndim, sizes..., strides...) -> the trace's view id (its Interner's)
  KeyMap views;
  bool sweeping = true;  // off only to measure what sweeping gives (analysis/bench_overhead.py)

  // (handles, data_ptrs, nbytes as int64 bytes; device names) of storages n.. on.
  PyObject* since(size_t n) const {
    n = std::min(n, handles_.size());
    const size_t m = handles_.size() - n;
    Ref handles(bytes_of(handles_.data() + n, m));
    Ref data_ptrs(bytes_of(data_ptrs_.data() + n, m));
    Ref nbytes(bytes_of(nbytes_.data() + n, m));
    Ref names(PyList_New(static_cast<Py_ssize_t>(m)));
    for (size_t i = 0; i < m; ++i) {
      PyObject* name = check(PyUnicode_FromString(device_names_[devices_[n + i]].c_str()));
      PyList_SET_ITEM(names.p, static_cast<Py_ssize_t>(i), name);
    }
    return PyTuple_Pack(4, handles.p, data_ptrs.p, nbytes.p, names.p);
  }

  PyObject* handles_from(size_t n) const {
    n = std::min(n, handles_.size());
    return bytes_of(handles_.data() + n, handles_.size() - n);
  }

  void release() {
    for (int64_t h : handles_) {
      if (h != 0) c10::raw::weak_intrusive_ptr::decref(reinterpret_cast<c10::StorageImpl*>(h));
    }
    handles_.clear();
    data_ptrs_.clear();
    nbytes_.clear();
    devices_.clear();
    index_.clear();
  }

 private:
  static PyObject* bytes_of(const int64_t* data, size_t n) {
    return check(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(data),
                                           static_cast<Py_ssize_t>(n * sizeof(int64_t))));
  }

  static constexpr size_t kSweepLag = 32, kSweepBatch = 32;
  size_t swept_ = 0;        // storages below this id had their first check
  uint64_t released_ = 0;   // handles released by sweeps: Python rereads its copy on a change
  ska::flat_hash_map<const void*, int64_t> index_;  // live address -> storage id
  std::vector<int64_t> handles_, data_ptrs_, nbytes_;
  std::vector<int32_t> devices_;
  std::unordered_map<int64_t, int32_t> device_ids_;
  std::vector<std::string> device_names_;
};

struct StoragesObject {
  PyObject_HEAD
  Table* table;
};

PyTypeObject StoragesType = {PyVarObject_HEAD_INIT(nullptr, 0)};

class Writer {
 public:
  // Borrowed on entry, owned from here on.
  PyObject* ops_arr = nullptr;      // Capture.ops, array('i')
  PyObject* modules_arr = nullptr;  // Capture.op_modules, array('i')
  PyObject* rows_arr = nullptr;     // Capture.accesses, array('q')
  PyObject* storages = nullptr;     // a Storages object (owned), for its table:
  Table* table = nullptr;
  PyObject* views = nullptr;        // Interner: (dtype, shape, stride, offset) -> view id
  PyObject* plan_fn = nullptr;      // func -> _Plan
  PyObject* stack = nullptr;        // the capturing thread's module stack (a list of FQN ids)
  PyObject* fallback = nullptr;     // PyWriter.fallback
  PyObject* size_type = nullptr;    // torch.Size

  ~Writer() {
    for (auto& kv : plans_) {
      Py_DECREF(kv.first);
      Py_XDECREF(kv.second.by_keyword);
    }
    for (PyObject* p : {ops_arr, modules_arr, rows_arr, storages, views, plan_fn, stack,
                        fallback, size_type}) {
      Py_XDECREF(p);
    }
  }

  // One op: rows appended; returns kReplayWrote if it wrote an input, | kReplayFresh if it
  // made a fresh output.
  int record(PyObject* func, PyObject* args, PyObject* kwargs, PyObject* out) {
    Plan& plan = plan_for(func);
    if (plan.opaque) throw Fallback();  // ScriptObject arguments: recorded by the Python writer
    if (!PyTuple_Check(args) || (kwargs != Py_None && !PyDict_Check(kwargs))) throw Fallback();
    Py_ssize_t flushed = PyObject_Length(ops_arr);
    if (flushed < 0) throw PythonError();
    const int64_t seq = flushed + static_cast<int64_t>(ops_.size());
    ops_.push_back(static_cast<int32_t>(plan.op_id));
    modules_.push_back(static_cast<int32_t>(current_module()));
    inputs_.clear();
    const size_t start = rows_.size();
    bool wrote = false;

    const Py_ssize_t n = std::min<Py_ssize_t>(PyTuple_GET_SIZE(args),
                                              static_cast<Py_ssize_t>(plan.positional.size()));
    for (Py_ssize_t i = 0; i < n; ++i) {
      const int64_t code = plan.positional[i];
      if (code < 0) continue;
      PyObject* v = PyTuple_GET_ITEM(args, i);
      if (is_scalar(v)) continue;
      wrote |= put(seq, code, v, &plan.memo[i]) && code_access(code) == kWrite;
    }
    if (kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0) {
      Py_ssize_t pos = 0;
      PyObject *name, *v;
      while (PyDict_Next(kwargs, &pos, &name, &v)) {
        PyObject* code_obj = PyDict_GetItemWithError(plan.by_keyword, name);
        if (code_obj == nullptr) {
          if (PyErr_Occurred()) throw PythonError();
          continue;
        }
        if (is_scalar(v)) continue;
        const int64_t code = as_int(code_obj);
        wrote |= put(seq, code, v) && code_access(code) == kWrite;
      }
    }
    const size_t end_inputs = rows_.size();

    bool fresh = false;
    const int64_t first = plan.returns.empty() ? -1 : plan.returns[0];
    if (is_exact_tensor(out)) {
      if (first >= 0) {
        const int64_t slot = slot_of(out);
        const bool is_fresh = !is_input(slot_storage(slot));
        push(seq, first | (is_fresh ? kFactory : kView), slot);
        fresh = is_fresh;
      }
    } else if (PyTuple_Check(out) || PyList_Check(out)) {
      if (plan.returns.size() == 1) {  // one return slot: `out` is its Tensor[] (unbind, split)
        if (first >= 0) fresh = put_output(seq, first, out);
      } else {
        const Py_ssize_t m = PySequence_Fast_GET_SIZE(out);
        for (Py_ssize_t i = 0; i < m; ++i) {
          const int64_t name =
              i < static_cast<Py_ssize_t>(plan.returns.size()) ? plan.returns[i] : -1;
          if (name >= 0) fresh |= put_output(seq, name, PySequence_Fast_GET_ITEM(out, i));
        }
      }
    } else if (THPVariable_Check(out)) {
      if (!THPVariable_CheckExact(out)) throw Fallback();
      if (first >= 0) fresh = put_output(seq, first, out);
    }
    if (plan.may_alias) unalias(start, end_inputs);
    return (wrote ? kReplayWrote : 0) | (fresh ? kReplayFresh : 0);
  }

  void rollback(size_t n_ops, size_t n_rows) {
    ops_.resize(n_ops);
    modules_.resize(n_ops);
    rows_.resize(n_rows);
  }

  size_t n_ops() const { return ops_.size(); }
  size_t n_rows() const { return rows_.size(); }

  // Move the buffered rows into the capture's arrays.
  void flush() {
    if (ops_.empty()) return;
    extend(ops_arr, ops_.data(), ops_.size() * sizeof(int32_t));
    extend(modules_arr, modules_.data(), modules_.size() * sizeof(int32_t));
    extend(rows_arr, rows_.data(), rows_.size() * sizeof(int64_t));
    ops_.clear();
    modules_.clear();
    rows_.clear();
  }

 private:
  ska::flat_hash_map<PyObject*, Plan> plans_;
  std::vector<int64_t> key_;  // the view being looked up: (dtype, offset, ndim, sizes, strides)
  std::vector<int64_t> inputs_;
  std::vector<int32_t> ops_, modules_;
  std::vector<int64_t> rows_;

  static void extend(PyObject* arr, const void* data, size_t n) {
    Ref bytes(PyBytes_FromStringAndSize(static_cast<const char*>(data), n));
    Ref r(PyObject_CallMethod(arr, "frombytes", "O", bytes.p));
  }

  Plan& plan_for(PyObject* func) {
    auto it = plans_.find(func);
    if (it != plans_.end()) return it->second;
    Ref py(PyObject_CallOneArg(plan_fn, func));
    Plan plan;
    plan.op_id = as_int(Ref(PyObject_GetAttrString(py.p, "op_id")).p);
    Ref positional(PyObject_GetAttrString(py.p, "positional"));
    Ref returns(PyObject_GetAttrString(py.p, "returns"));
    Ref may_alias(PyObject_GetAttrString(py.p, "may_alias"));
    if (!PyTuple_Check(positional.p) || !PyTuple_Check(returns.p)) {
      PyErr_SetString(PyExc_TypeError, "graphtrace: a plan's positional/returns must be tuples");
      throw PythonError();
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(positional.p); ++i)
      plan.positional.push_back(optional_code(PyTuple_GET_ITEM(positional.p, i)));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(returns.p); ++i)
      plan.returns.push_back(optional_code(PyTuple_GET_ITEM(returns.p, i)));
    int truth = PyObject_IsTrue(may_alias.p);
    if (truth < 0) throw PythonError();
    plan.may_alias = truth;
    Ref opaque(PyObject_GetAttrString(py.p, "opaque"));
    truth = PyObject_IsTrue(opaque.p);
    if (truth < 0) throw PythonError();
    plan.opaque = truth;
    plan.by_keyword = check(PyObject_GetAttrString(py.p, "by_keyword"));
    if (!PyDict_Check(plan.by_keyword)) {
      Py_DECREF(plan.by_keyword);
      PyErr_SetString(PyExc_TypeError, "graphtrace: a plan's by_keyword must be a dict");
      throw PythonError();
    }
    plan.memo.resize(plan.positional.size());
    Py_INCREF(func);
    return plans_.emplace(func, std::move(plan)).first->second;
  }

  int64_t current_module() {
    Py_ssize_t n = PyList_GET_SIZE(stack);
    return n == 0 ? -1 : as_int(PyList_GET_ITEM(stack, n - 1));
  }

  bool is_input(int64_t sid) const {
    for (int64_t s : inputs_) if (s == sid) return true;
    return false;
  }

  void push(int64_t seq, int64_t code, int64_t slot) {
    rows_.push_back(seq);
    rows_.push_back(code);
    rows_.push_back(slot);
  }

  // An input argument: a tensor or a (nested) list/tuple of them. True when a tensor was found.
  bool put(int64_t seq, int64_t code, PyObject* v, ArgMemo* memo = nullptr) {
    if (THPVariable_CheckExact(v)) {
      const int64_t slot = slot_of(v, memo);
      push(seq, code, slot);
      inputs_.push_back(slot_storage(slot));
      return true;
    }
    if (THPVariable_Check(v) || PyDict_Check(v)) throw Fallback();  // subclasses: flattened in Python
    if (PyTuple_Check(v) || PyList_Check(v)) {
      bool found = false;
      const Py_ssize_t m = PySequence_Fast_GET_SIZE(v);
      for (Py_ssize_t i = 0; i < m; ++i) found |= put(seq, code, PySequence_Fast_GET_ITEM(v, i));
      return found;
    }
    return false;  // a leaf that is no tensor
  }

  // An output: a view when its storage is one of the op's inputs, else fresh (factory).
  bool put_output(int64_t seq, int64_t name, PyObject* v) {
    if (THPVariable_CheckExact(v)) {
      const at::Tensor& t = THPVariable_Unpack(v);
      const int64_t sid = table->find(storage_impl(t));
      const bool is_view = sid >= 0 && is_input(sid);
      push(seq, name | (is_view ? kView : kFactory), slot_of(v));
      return !is_view;
    }
    if (THPVariable_Check(v) || PyDict_Check(v)) throw Fallback();
    if (PyTuple_Check(v) || PyList_Check(v)) {
      bool fresh = false;
      const Py_ssize_t m = PySequence_Fast_GET_SIZE(v);
      for (Py_ssize_t i = 0; i < m; ++i) fresh |= put_output(seq, name, PySequence_Fast_GET_ITEM(v, i));
      return fresh;
    }
    return false;
  }

  static c10::StorageImpl* storage_impl(const at::Tensor& t) {
    if (!t.has_storage()) throw Fallback();
    return t.storage().unsafeGetStorageImpl();
  }

  // The tensor's slot (pack_slot): two hash hits for any storage and view seen before.
  int64_t slot_of(PyObject* v, ArgMemo* memo = nullptr) {
    const at::Tensor& t = THPVariable_Unpack(v);
    c10::StorageImpl* impl = storage_impl(t);
    auto sizes = t.sizes();  // throws for symbolic shapes: the Python writer reports those
    auto strides = t.strides();
    key_.clear();
    key_.push_back(static_cast<int64_t>(t.scalar_type()));
    key_.push_back(t.storage_offset());
    key_.push_back(static_cast<int64_t>(sizes.size()));
    key_.insert(key_.end(), sizes.begin(), sizes.end());
    key_.insert(key_.end(), strides.begin(), strides.end());
    const size_t n = key_.size();
    if (memo != nullptr && memo->impl == impl && memo->n == n &&
        std::memcmp(memo->key, key_.data(), n * sizeof(int64_t)) == 0 &&
        table->handle(slot_storage(memo->slot)) == reinterpret_cast<int64_t>(impl)) {
      return memo->slot;
    }
    const int64_t sid = table->add(impl);
    auto it = table->views.find(key_);
    const int64_t slot = pack_slot(sid, it != table->views.end() ? it->second : view_id(t));
    if (memo != nullptr && n <= ArgMemo::kMaxKey) {
      memo->impl = impl;
      memo->slot = slot;
      memo->n = n;
      std::memcpy(memo->key, key_.data(), n * sizeof(int64_t));
    }
    return slot;
  }

  static PyObject* int_tuple(const int64_t* values, int64_t n) {
    PyObject* tuple = check(PyTuple_New(n));
    for (int64_t i = 0; i < n; ++i) {
      PyObject* v = PyLong_FromLongLong(values[i]);
      if (v == nullptr) {
        Py_DECREF(tuple);
        throw PythonError();
      }
      PyTuple_SET_ITEM(tuple, i, v);
    }
    return tuple;
  }

  // A view not seen yet (key_ holds it): its id from the trace's Interner, then cached.
  int64_t view_id(const at::Tensor& t) {
    const int64_t ndim = key_[2];
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
    Ref sizes(int_tuple(key_.data() + 3, ndim));
    Ref shape(PyObject_CallOneArg(size_type, sizes.p));  // torch.Size, as Tensor.shape gives
    Ref stride(int_tuple(key_.data() + 3 + ndim, ndim));
    Ref offset(PyLong_FromLongLong(key_[1]));
    Ref item(PyTuple_Pack(4, dtype, shape.p, stride.p, offset.p));
    const int64_t vid = as_int(Ref(PyObject_CallOneArg(views, item.p)).p);
    table->views.emplace(key_, vid);
    return vid;
  }

  // `Tensor(a) self` may alias the output or not (aten::to copies on a dtype change): an
  // input the schema calls a view is a read when no output shares its storage.
  void unalias(size_t start, size_t end_inputs) {
    for (size_t i = start + 1; i < end_inputs; i += kAccessFields) {
      const int64_t code = rows_[i];
      if (code_access(code) != kView) continue;
      const int64_t sid = slot_storage(rows_[i + 1]);
      bool shared = false;
      for (size_t j = end_inputs + 2; j < rows_.size(); j += kAccessFields) {
        if (slot_storage(rows_[j]) == sid) { shared = true; break; }
      }
      if (!shared) rows_[i] = with_access(code, kRead);
    }
  }
};

// --------------------------------------------------------------------------- Python type

struct PyWriterObject {
  PyObject_HEAD
  Writer* writer;
};

PyTypeObject WriterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

int Writer_init(PyWriterObject* self, PyObject* args, PyObject* kwds) {
  static const char* names[] = {"capture", "storages", "views", "plan", "stack",
                                "fallback", nullptr};
  PyObject *capture, *storages, *views, *plan, *stack, *fallback;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO", const_cast<char**>(names), &capture,
                                   &storages, &views, &plan, &stack, &fallback)) {
    return -1;
  }
  auto w = new Writer();
  w->ops_arr = PyObject_GetAttrString(capture, "ops");
  w->modules_arr = PyObject_GetAttrString(capture, "op_modules");
  w->rows_arr = PyObject_GetAttrString(capture, "accesses");
  if (Py_TYPE(storages) != &StoragesType) {
    PyErr_SetString(PyExc_TypeError, "graphtrace: Writer needs a graphtrace native Storages table");
    delete w;
    return -1;
  }
  Py_INCREF(storages);
  w->storages = storages;
  w->table = reinterpret_cast<StoragesObject*>(storages)->table;
  Py_INCREF(views);
  w->views = views;
  Py_INCREF(plan);
  w->plan_fn = plan;
  if (!PyList_Check(stack)) {
    PyErr_SetString(PyExc_TypeError, "graphtrace: Writer needs the thread's module stack (a list)");
    delete w;
    return -1;
  }
  Py_INCREF(stack);
  w->stack = stack;
  Py_INCREF(fallback);
  w->fallback = fallback;
  PyObject* torch_module = PyImport_ImportModule("torch");
  if (torch_module != nullptr) {
    w->size_type = PyObject_GetAttrString(torch_module, "Size");
    Py_DECREF(torch_module);
  }
  if (PyErr_Occurred() || !w->size_type) {
    delete w;
    return -1;
  }
  delete self->writer;
  self->writer = w;
  return 0;
}

void Writer_dealloc(PyWriterObject* self) {
  delete self->writer;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

Writer* writer_of(PyWriterObject* self) {
  if (self->writer == nullptr) PyErr_SetString(PyExc_RuntimeError, "graphtrace: Writer not initialised");
  return self->writer;
}

PyObject* Writer_record(PyWriterObject* self, PyObject* const* args, Py_ssize_t nargs) {
  Writer* w = writer_of(self);
  if (w == nullptr) return nullptr;
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "record(func, args, kwargs, out) takes 4 arguments");
    return nullptr;
  }
  const size_t n_ops = w->n_ops(), n_rows = w->n_rows();
  try {
    return PyLong_FromLong(w->record(args[0], args[1], args[2], args[3]));
  } catch (const PythonError&) {
    w->rollback(n_ops, n_rows);
    return nullptr;
  } catch (const Fallback&) {
  } catch (const std::exception&) {  // c10::Error: symbolic shapes, no storage, ...
  }
  // The Python writer handles this op (and reports what it cannot): rows stay in order.
  w->rollback(n_ops, n_rows);
  try {
    w->flush();
  } catch (const PythonError&) {
    return nullptr;
  }
  return PyObject_Vectorcall(w->fallback, args, 4, nullptr);
}

// The class whose exact instances native_dispatch calls through `_op` (configure()); null: none.
PyObject* op_overload_type = nullptr;

PyObject* configure(PyObject*, PyObject* arg) {
  if (arg != Py_None && !PyType_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "configure(OpOverload class or None)");
    return nullptr;
  }
  Py_XDECREF(op_overload_type);
  op_overload_type = arg == Py_None ? nullptr : arg;
  Py_XINCREF(op_overload_type);
  Py_RETURN_NONE;
}

// Note [native dispatch]
// ~~~~~~~~~~~~~~~~~~~~~~
// RecordingMode.__torch_dispatch__ in C: torch calls a mode's `__torch_dispatch__` attribute
// with (func, types, args, kwargs) and requires its `__self__` to be the mode, so the mode
// binds this function to itself (types.MethodType) when it records with the native writer.
// It runs the op exactly as the Python method does (`func(*args, **kwargs)`), then hands the
// call to `mode.fast_writer` (a Writer, or None while the mode also keeps ops for an emulated
// graph: then `mode.after_op`, the Python path). A recording error goes to
// `mode.record_failed(func, exc)`, which counts it or, in strict mode, raises it. What this
// saves is the Python frame per op, which is most of what a dispatch mode costs.
PyObject* native_dispatch(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n < 4 || n > 5) {
    PyErr_SetString(PyExc_TypeError, "dispatch(mode, func, types, args, kwargs=None)");
    return nullptr;
  }
  static PyObject* s_fast = PyUnicode_InternFromString("fast_writer");
  static PyObject* s_after = PyUnicode_InternFromString("after_op");
  static PyObject* s_failed = PyUnicode_InternFromString("record_failed");
  if (s_fast == nullptr || s_after == nullptr || s_failed == nullptr) return nullptr;
  PyObject* mode = a[0];
  PyObject* func = a[1];
  PyObject* args = a[3];
  PyObject* kwargs = n == 5 ? a[4] : Py_None;
  if (!PyTuple_Check(args)) {
    PyErr_SetString(PyExc_TypeError, "graphtrace: __torch_dispatch__ args must be a tuple");
    return nullptr;
  }
  if (kwargs != Py_None && !PyDict_Check(kwargs)) {
    PyErr_SetString(PyExc_TypeError, "graphtrace: __torch_dispatch__ kwargs must be a dict");
    return nullptr;
  }
  const bool has_kwargs = kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0;
  // An exact OpOverload whose __call__ is `self._op(*args, **kwargs)` (graphtrace.native checks
  // that and hands the class to configure()): call `_op` directly, one Python frame less per
  // op; subclasses (TorchBindOpOverload) and other callables as given.
  static PyObject* s_op = PyUnicode_InternFromString("_op");
  PyObject* target = nullptr;
  if (s_op != nullptr && op_overload_type != nullptr &&
      Py_TYPE(func) == reinterpret_cast<PyTypeObject*>(op_overload_type)) {
    target = PyObject_GetAttr(func, s_op);
    if (target == nullptr) PyErr_Clear();
  }
  PyObject* out = PyObject_Call(target ? target : func, args, has_kwargs ? kwargs : nullptr);
  Py_XDECREF(target);
  if (out == nullptr) return nullptr;  // the op's own error, as the op raised it
  PyObject* writer = PyObject_GetAttr(mode, s_fast);
  if (writer == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  PyObject* done;
  if (Py_TYPE(writer) == &WriterType) {
    PyObject* rec[4] = {func, args, kwargs == Py_None ? Py_None : kwargs, out};
    done = Writer_record(reinterpret_cast<PyWriterObject*>(writer), rec, 4);
    if (done == nullptr) {  // fail open, through the mode (strict mode raises there)
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      PyErr_NormalizeException(&type, &value, &tb);
      if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
      done = PyObject_CallMethodObjArgs(mode, s_failed, func, value ? value : Py_None, nullptr);
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
    }
  } else {
    PyObject* empty = nullptr;
    if (kwargs == Py_None) {
      empty = PyDict_New();
      if (empty == nullptr) {
        Py_DECREF(writer);
        Py_DECREF(out);
        return nullptr;
      }
    }
    done = PyObject_CallMethodObjArgs(mode, s_after, func, args, empty ? empty : kwargs, out,
                                      nullptr);
    Py_XDECREF(empty);
  }
  Py_DECREF(writer);
  if (done == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  Py_DECREF(done);
  return out;
}

// Owner paths still reaching the storages they reached (graphtrace.owners.PathSet.moved),
// followed as graphtrace.owners._step does: an attribute of an nn.Module from its registries
// (`_parameters`, `_buffers`, `_modules`), then its `__dict__`; of another object from its
// `__dict__`, then getattr; a key of a dict or an index of a list or tuple. Anything else
// (closures, dict subclasses, a getattr that raises, ...) is left undecided, for Python, as are
// leaves that are not plain tensors or Parameters. `nodes` is a list of (parent node or -1,
// step, is_key), parents first; `leaves` the node of each path; `expected` the StorageImpl
// address each reached. Returns True when a decided leaf now reaches another storage (or
// none), else the list of undecided path positions.
PyObject* paths_moved(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 6 || !PyType_Check(a[1]) || !PyType_Check(a[2]) || !PyList_Check(a[3]) ||
      !PyList_Check(a[4]) || !PyList_Check(a[5]) ||
      PyList_GET_SIZE(a[4]) != PyList_GET_SIZE(a[5])) {
    PyErr_SetString(PyExc_TypeError,
                    "paths_moved(model, module_type, parameter_type, nodes, leaves, expected)");
    return nullptr;
  }
  static PyObject* registries[3] = {PyUnicode_InternFromString("_parameters"),
                                    PyUnicode_InternFromString("_buffers"),
                                    PyUnicode_InternFromString("_modules")};
  static PyObject* s_closure = PyUnicode_InternFromString("__closure__");
  PyObject *model = a[0], *nodes = a[3], *leaves = a[4], *expected = a[5];
  auto* module_type = reinterpret_cast<PyTypeObject*>(a[1]);
  auto* parameter_type = reinterpret_cast<PyTypeObject*>(a[2]);
  const Py_ssize_t m = PyList_GET_SIZE(nodes);
  std::vector<PyObject*> objs(static_cast<size_t>(m), nullptr);  // borrowed; nullptr: undecided
  std::vector<PyObject*> held;  // new references taken on the way
  struct Release {
    std::vector<PyObject*>& refs;
    ~Release() { for (PyObject* r : refs) Py_DECREF(r); }
  } release{held};
  auto own = [&held](PyObject* obj) {
    if (obj != nullptr) held.push_back(obj);
    return obj;
  };
  for (Py_ssize_t i = 0; i < m; ++i) {
    PyObject* node = PyList_GET_ITEM(nodes, i);
    if (!PyTuple_Check(node) || PyTuple_GET_SIZE(node) != 3) {
      PyErr_SetString(PyExc_TypeError, "paths_moved: a node is (parent, step, is_key)");
      return nullptr;
    }
    const Py_ssize_t parent = PyLong_AsSsize_t(PyTuple_GET_ITEM(node, 0));
    if (parent == -1 && PyErr_Occurred()) return nullptr;
    PyObject* obj = parent < 0 ? model : (parent < i ? objs[parent] : nullptr);
    if (obj == nullptr) continue;
    PyObject* step = PyTuple_GET_ITEM(node, 1);
    PyObject* found = nullptr;
    if (PyTuple_GET_ITEM(node, 2) == Py_True) {  // a key or an index
      if (PyDict_CheckExact(obj)) {
        found = PyDict_GetItemWithError(obj, step);
      } else if ((PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) && PyLong_CheckExact(step)) {
        const Py_ssize_t len = PySequence_Fast_GET_SIZE(obj);
        Py_ssize_t k = PyLong_AsSsize_t(step);
        if (k == -1 && PyErr_Occurred()) PyErr_Clear();
        else if (-len <= k && k < len) found = PySequence_Fast_GET_ITEM(obj, k < 0 ? k + len : k);
      }
    } else if (PyUnicode_CheckExact(step) && PyUnicode_Compare(step, s_closure) != 0) {
      const bool is_module = PyObject_TypeCheck(obj, module_type);
      PyObject* d = own(PyObject_GenericGetDict(obj, nullptr));
      if (d == nullptr) PyErr_Clear();  // no __dict__: getattr below
      if (d != nullptr && PyDict_Check(d)) {
        if (is_module) {
          for (PyObject* name : registries) {
            PyObject* reg = PyDict_GetItemWithError(d, name);
            if (reg != nullptr && PyDict_Check(reg) && PyDict_GET_SIZE(reg) > 0) {
              found = PyDict_GetItemWithError(reg, step);
              if (found != nullptr || PyErr_Occurred()) break;
            } else if (PyErr_Occurred()) {
              break;
            }
          }
        }
        if (found == nullptr && !PyErr_Occurred()) found = PyDict_GetItemWithError(d, step);
      }
      if (found == nullptr && !PyErr_Occurred() && !is_module) {
        found = own(PyObject_GetAttr(obj, step));  // properties, members (partial.keywords)
        if (found == nullptr) PyErr_Clear();        // raised: undecided, Python says how
        objs[i] = found;
        continue;
      }
    }
    if (found == nullptr && PyErr_Occurred()) return nullptr;
    // a miss stays undecided: Python follows that path the general way. A hit is held: a
    // getattr further on may run code that drops it from the container it was borrowed from
    objs[i] = found == nullptr ? nullptr : own(Py_NewRef(found));
  }
  PyObject* undecided = PyList_New(0);
  if (undecided == nullptr) return nullptr;
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(leaves); ++j) {
    const Py_ssize_t leaf = PyLong_AsSsize_t(PyList_GET_ITEM(leaves, j));
    if (leaf == -1 && PyErr_Occurred()) {
      Py_DECREF(undecided);
      return nullptr;
    }
    PyObject* obj = leaf >= 0 && leaf < m ? objs[leaf] : nullptr;
    if (obj == nullptr || !(is_exact_tensor(obj) || Py_TYPE(obj) == parameter_type)) {
      PyObject* index = PyLong_FromSsize_t(j);
      if (index == nullptr || PyList_Append(undecided, index) < 0) {
        Py_XDECREF(index);
        Py_DECREF(undecided);
        return nullptr;
      }
      Py_DECREF(index);
      continue;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    void* want = PyLong_AsVoidPtr(PyList_GET_ITEM(expected, j));
    if (want == nullptr && PyErr_Occurred()) {
      Py_DECREF(undecided);
      return nullptr;
    }
    if (!t.has_storage() || t.storage().unsafeGetStorageImpl() != want) {
      Py_DECREF(undecided);
      Py_RETURN_TRUE;
    }
  }
  return undecided;
}

// The sum of the version counters of the tensors a list of weak references reaches
// (graphtrace.vllm.serve.ServeGuard.written_in_place: Note [in-place writes] in
// graphtrace/vllm/serve.py): -1 when one is gone, None (Python decides) when one reaches
// something else than a tensor or an inference tensor (it has no version counter).
PyObject* versions_sum(PyObject*, PyObject* refs) {
  if (!PyList_Check(refs)) {
    PyErr_SetString(PyExc_TypeError, "versions_sum(refs): a list of weak references");
    return nullptr;
  }
  int64_t total = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refs); ++i) {
    PyObject* ref = PyList_GET_ITEM(refs, i);
    if (!PyWeakref_CheckRef(ref)) {
      PyErr_SetString(PyExc_TypeError, "versions_sum(refs): a list of weak references");
      return nullptr;
    }
    PyObject* obj = PyWeakref_GET_OBJECT(ref);  // borrowed; no Python code runs below
    if (obj == Py_None) return PyLong_FromLong(-1);
    if (!THPVariable_Check(obj)) Py_RETURN_NONE;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.is_inference()) Py_RETURN_NONE;
    total += static_cast<int64_t>(t._version());
  }
  return PyLong_FromLongLong(total);
}

PyMethodDef module_methods[] = {
    {"configure", reinterpret_cast<PyCFunction>(configure), METH_O,
     "configure(cls): the class whose exact instances dispatch() calls through `_op` (None: none)"},
    {"paths_moved", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(paths_moved)),
     METH_FASTCALL,
     "paths_moved(model, module_type, parameter_type, nodes, leaves, expected) -> True, or the "
     "undecided "
     "paths' positions (graphtrace.owners.PathSet.moved)"},
    {"versions_sum", reinterpret_cast<PyCFunction>(versions_sum), METH_O,
     "versions_sum(refs) -> the sum of the version counters of the tensors the weak "
     "references reach, -1 if one is gone, None if one is not a tensor with a counter"},
    {"dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(native_dispatch)),
     METH_FASTCALL,
     "dispatch(mode, func, types, args, kwargs=None): RecordingMode.__torch_dispatch__ in C "
     "(Note [native dispatch] in graphtrace/csrc/recorder.cpp)"},
    {nullptr, nullptr, 0, nullptr}};

PyObject* Writer_flush(PyWriterObject* self, PyObject*) {
  Writer* w = writer_of(self);
  if (w == nullptr) return nullptr;
  try {
    w->flush();
  } catch (const PythonError&) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef writer_methods[] = {
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Writer_record)),
     METH_FASTCALL, "record(func, args, kwargs, out) -> replay flags (1: wrote, 2: fresh output)"},
    {"flush", reinterpret_cast<PyCFunction>(Writer_flush), METH_NOARGS,
     "move buffered rows into the capture's arrays"},
    {nullptr, nullptr, 0, nullptr}};


// --------------------------------------------------------------------------- Storages type

PyObject* Storages_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  reinterpret_cast<StoragesObject*>(self)->table = new Table();
  return self;
}

void Storages_dealloc(StoragesObject* self) {
  delete self->table;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

const void* impl_arg(PyObject* arg) {
  void* p = PyLong_AsVoidPtr(arg);
  if (p == nullptr && PyErr_Occurred()) throw PythonError();
  return p;
}

PyObject* Storages_find(StoragesObject* self, PyObject* arg) {
  try {
    return PyLong_FromLongLong(self->table->find(impl_arg(arg)));
  } catch (const PythonError&) {
    return nullptr;
  }
}

PyObject* Storages_register(StoragesObject* self, PyObject* arg) {
  try {
    auto* impl = static_cast<c10::StorageImpl*>(const_cast<void*>(impl_arg(arg)));
    return PyLong_FromLongLong(self->table->add(impl));
  } catch (const PythonError&) {
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* Storages_since(StoragesObject* self, PyObject* arg) {
  Py_ssize_t n = PyLong_AsSsize_t(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  try {
    return self->table->since(n < 0 ? 0 : static_cast<size_t>(n));
  } catch (const PythonError&) {
    return nullptr;
  }
}

PyObject* Storages_memory(StoragesObject* self, PyObject*) {
  return PyLong_FromSize_t(self->table->memory());
}

PyObject* Storages_release(StoragesObject* self, PyObject*) {
  self->table->release();
  Py_RETURN_NONE;
}

bool sid_arg(PyObject* arg, int64_t* sid) {
  *sid = PyLong_AsLongLong(arg);
  return !(*sid == -1 && PyErr_Occurred());
}

PyObject* Storages_sweep(StoragesObject* self, PyObject* arg) {
  int64_t from;
  if (!sid_arg(arg, &from)) return nullptr;
  self->table->sweep(from < 0 ? 0 : static_cast<size_t>(from), self->table->size());
  Py_RETURN_NONE;
}

PyObject* Storages_set_sweeping(StoragesObject* self, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  self->table->sweeping = on;
  Py_RETURN_NONE;
}

PyObject* Storages_released(StoragesObject* self, PyObject*) {
  return PyLong_FromUnsignedLongLong(self->table->released());
}

PyObject* Storages_handles(StoragesObject* self, PyObject*) {
  try {
    return self->table->handles_from(0);
  } catch (const PythonError&) {
    return nullptr;
  }
}

PyObject* Storages_handles_from(StoragesObject* self, PyObject* arg) {
  int64_t n;
  if (!sid_arg(arg, &n)) return nullptr;
  try {
    return self->table->handles_from(n < 0 ? 0 : static_cast<size_t>(n));
  } catch (const PythonError&) {
    return nullptr;
  }
}

PyObject* Storages_alive(StoragesObject* self, PyObject* arg) {
  int64_t sid;
  if (!sid_arg(arg, &sid)) return nullptr;
  return PyBool_FromLong(self->table->alive(sid));
}

PyObject* Storages_alive_mask(StoragesObject* self, PyObject*) {
  const size_t n = self->table->size();
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
  if (out == nullptr) return nullptr;
  char* p = PyBytes_AS_STRING(out);
  for (size_t i = 0; i < n; ++i) p[i] = self->table->alive(static_cast<int64_t>(i)) ? 1 : 0;
  return out;
}

// A strong reference (an UntypedStorage) to storage `sid` if it is still alive, else None.
PyObject* Storages_upgrade(StoragesObject* self, PyObject* arg) {
  int64_t sid;
  if (!sid_arg(arg, &sid)) return nullptr;
  const int64_t h = self->table->handle(sid);
  if (h <= 0) Py_RETURN_NONE;
  c10::StorageImpl* strong =
      c10::raw::weak_intrusive_ptr::lock(reinterpret_cast<c10::StorageImpl*>(h));
  if (strong == nullptr) Py_RETURN_NONE;
  return THPStorage_Wrap(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim(strong)));
}

Py_ssize_t Storages_len(StoragesObject* self) {
  return static_cast<Py_ssize_t>(self->table->size());
}

PyMethodDef storages_methods[] = {
    {"find", reinterpret_cast<PyCFunction>(Storages_find), METH_O,
     "find(storage._cdata) -> storage id, or -1 when not registered"},
    {"register", reinterpret_cast<PyCFunction>(Storages_register), METH_O,
     "register(storage._cdata) -> storage id; the caller keeps the storage alive meanwhile"},
    {"since", reinterpret_cast<PyCFunction>(Storages_since), METH_O,
     "since(n) -> (handles, data_ptrs, nbytes: int64 bytes; device names) of storages n.."},
    {"release", reinterpret_cast<PyCFunction>(Storages_release), METH_NOARGS,
     "free every weak handle"},
    {"memory", reinterpret_cast<PyCFunction>(Storages_memory), METH_NOARGS,
     "heap bytes of the table's containers"},
    {"sweep", reinterpret_cast<PyCFunction>(Storages_sweep), METH_O,
     "sweep(from_sid): release the handles of dead storages from from_sid on"},
    {"set_sweeping", reinterpret_cast<PyCFunction>(Storages_set_sweeping), METH_O,
     "set_sweeping(flag): release dead storages' handles as registration goes (default on)"},
    {"released", reinterpret_cast<PyCFunction>(Storages_released), METH_NOARGS,
     "how many handles sweeps released so far"},
    {"handles", reinterpret_cast<PyCFunction>(Storages_handles), METH_NOARGS,
     "every weak handle as int64 bytes (0: released)"},
    {"handles_from", reinterpret_cast<PyCFunction>(Storages_handles_from), METH_O,
     "handles_from(n) -> the weak handles of storages n.. as int64 bytes (0: released)"},
    {"alive", reinterpret_cast<PyCFunction>(Storages_alive), METH_O,
     "alive(sid) -> whether storage sid is still alive"},
    {"alive_mask", reinterpret_cast<PyCFunction>(Storages_alive_mask), METH_NOARGS,
     "one byte per storage: 1 alive, 0 freed"},
    {"upgrade", reinterpret_cast<PyCFunction>(Storages_upgrade), METH_O,
     "upgrade(sid) -> the UntypedStorage if still alive, else None"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods storages_sequence = {reinterpret_cast<lenfunc>(Storages_len)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "graphtrace native recorder",
                          "The recorder's per-op path in C++ (graphtrace/csrc/recorder.cpp).", -1,
                          module_methods};

}  // namespace

#define GT_CAT2(a, b) a##b
#define GT_CAT(a, b) GT_CAT2(a, b)

// One type's slots, set the same way for both types the module defines.
static bool ready_type(PyTypeObject& type, const char* name, Py_ssize_t size, const char* doc,
                       newfunc make, destructor dealloc, PyMethodDef* methods) {
  type.tp_name = name;
  type.tp_basicsize = size;
  type.tp_flags = Py_TPFLAGS_DEFAULT;
  type.tp_doc = doc;
  type.tp_new = make;
  type.tp_dealloc = dealloc;
  type.tp_methods = methods;
  return PyType_Ready(&type) >= 0;
}

PyMODINIT_FUNC GT_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  WriterType.tp_init = reinterpret_cast<initproc>(Writer_init);
  StoragesType.tp_as_sequence = &storages_sequence;
  if (!ready_type(WriterType, "graphtrace.native.Writer", sizeof(PyWriterObject),
                  "Records one capture's ops into its Capture (see graphtrace.recorder).",
                  PyType_GenericNew, reinterpret_cast<destructor>(Writer_dealloc),
                  writer_methods) ||
      !ready_type(StoragesType, "graphtrace.native.Storages", sizeof(StoragesObject),
                  "Every storage a trace has seen, by weak handle (see StorageTable).",
                  Storages_new, reinterpret_cast<destructor>(Storages_dealloc),
                  storages_methods))
    return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&WriterType);
  Py_INCREF(&StoragesType);
  if (PyModule_AddObject(m, "Writer", reinterpret_cast<PyObject*>(&WriterType)) < 0 ||
      PyModule_AddObject(m, "Storages", reinterpret_cast<PyObject*>(&StoragesType)) < 0 ||
      // the record encoding, under graphtrace/encoding.py's names (encoding.NATIVE_CONSTANTS)
      PyModule_AddIntConstant(m, "READ", kRead) < 0 ||
      PyModule_AddIntConstant(m, "WRITE", kWrite) < 0 ||
      PyModule_AddIntConstant(m, "VIEW", kView) < 0 ||
      PyModule_AddIntConstant(m, "FACTORY", kFactory) < 0 ||
      PyModule_AddIntConstant(m, "ACCESS_BITS", kAccessBits) < 0 ||
      PyModule_AddIntConstant(m, "ACCESS_MASK", kAccessMask) < 0 ||
      PyModule_AddIntConstant(m, "SID_SHIFT", kSidShift) < 0 ||
      PyModule_AddIntConstant(m, "ACCESS_FIELDS", static_cast<long>(kAccessFields)) < 0 ||
      PyModule_AddIntConstant(m, "REPLAY_WROTE", kReplayWrote) < 0 ||
      PyModule_AddIntConstant(m, "REPLAY_FRESH", kReplayFresh) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
