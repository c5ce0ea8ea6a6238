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
#include <algorithm>

#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

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
    const int64_t sid = static_cast<int64_t>(handles_.size());
    auto slot = index_.emplace(impl, sid);  // one probe, whether new or seen
    if (!slot.second) return slot.first->second;
    int64_t nb;
    int32_t dev;
    try {
      nb = static_cast<int64_t>(impl->nbytes());  // throws for symbolic sizes
      dev = device_id(impl->device());
    } catch (...) {
      index_.erase(impl);
      throw;
    }
    void* handle = c10::raw::intrusive_ptr::make_weak(impl);
    handles_.push_back(reinterpret_cast<int64_t>(handle));
    data_ptrs_.push_back(reinterpret_cast<int64_t>(impl->data_ptr().get()));
    nbytes_.push_back(nb);
    devices_.push_back(dev);
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
    n += (spare_ops.capacity() + spare_modules.capacity()) * 4 + spare_rows.capacity() * 8;
    n += (index_.bucket_count() + 1) * (8 + sizeof(std::pair<const void*, int64_t>)) + kMalloc;
    n += (views.bucket_count() + 1) * (8 + sizeof(std::pair<std::vector<int64_t>, int64_t>)) +
        kMalloc;
    for (const auto& kv : views) n += kv.first.capacity() * 8 + kMalloc;
    return n;
  }

  // (dtype, offset, ndim, sizes..., strides...) -> the trace's view id (its Interner's)
  KeyMap views;
  // Emptied record buffers that a writer's flush left, taken by the next op recorded in this
  // trace (Note [record buffers reused]).
  std::vector<int32_t> spare_ops, spare_modules;
  std::vector<int64_t> spare_rows;
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
  // The device's index into device_names_; consecutive storages are mostly on one device.
  int32_t device_id(const c10::Device& device) {
    const int64_t dkey = static_cast<int64_t>(device.type()) * 65536 + device.index() + 1;
    if (dkey == last_dkey_) return last_dev_;
    auto d = device_ids_.find(dkey);
    if (d == device_ids_.end()) {
      d = device_ids_.emplace(dkey, static_cast<int32_t>(device_names_.size())).first;
      device_names_.push_back(device.str());
    }
    last_dkey_ = dkey;
    last_dev_ = d->second;
    return last_dev_;
  }

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
  int64_t last_dkey_ = -1;  // -1: none yet (a real key is at least 0: CPU's)
  int32_t last_dev_ = 0;
};

struct StoragesObject {
  PyObject_HEAD
  Table* table;
};

PyTypeObject StoragesType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// --------------------------------------------------------------------------- Keeper

struct KeepFallback {};  // this op's arguments hold what the native walk does not: Python walks

// Note [native keep]
// ~~~~~~~~~~~~~~~~~~
// An emulated graph's per-op keep (Note [Emulated graphs keep storages] in
// graphtrace/tracing/emulated.py) in C++: the same aliases, ops and scratch as the Python keeper there
// (`_PyKeeper`, the reference), without a Python frame per op or per tensor. A Keeper belongs
// to one EmulatedGraph; the capture's Writer keeps each recorded op into it right after its
// rows (Writer.set_keeper), so the native dispatch runs no Python per op with emulate=True
// either. The walk covers tensors, scalars, dtypes/devices/layouts/memory formats, torch.Size
// and plain tuples and lists; anything else (dicts inside arguments, namedtuples, registered
// containers) makes the op go to the Python walker (`tracing._keep_slow`), which pins through
// this keeper's `pin`, so one view is one alias either way. An alias is
// `shallow_copy_and_detach` with t's version counter (what `t.detach()` makes: a new
// TensorImpl on t's storage and view), or for an inference tensor a normal TensorImpl on its
// storage made outside inference mode (what `empty(0).set_(...)` makes).
// seal() decides scratch as the Python keeper does (a storage made in the region that only
// the graph's aliases hold, by its use count) and empties those aliases in place: a 0-byte
// storage and size 0, their view kept here. lend() points them at fresh storages for a
// replay, reclaim() empties them again, so the kept ops never change and a replay maps
// nothing. The alias map and the seen/made sets are dropped at seal: nothing keeps ops then.
class Keeper {
 public:
  PyObject* ops = nullptr;           // list of kept ops, (func, args, kwargs, out, flags)
  PyObject* slow = nullptr;          // tracing._keep_slow(keeper, func, args, kwargs, out, flags)
  PyObject* empty_kwargs = nullptr;  // shared by ops without keyword arguments
  PyObject* floats = nullptr;        // dict: each float the kept ops take -> the first op
  bool release = true;               // storages made in the region may become scratch

  ~Keeper() {
    clear_aliases();
    for (auto& s : scratch_)
      for (auto& l : s.lent) Py_XDECREF(l.alias);
    Py_XDECREF(floats);
    Py_XDECREF(ops);
    Py_XDECREF(slow);
    Py_XDECREF(empty_kwargs);
  }

  // Keep one recorded op (flags: its replay flags, not 0). Throws KeepFallback before
  // appending anything when the walk meets what it does not handle.
  void keep(PyObject* func, PyObject* args, PyObject* kwargs, PyObject* out, int flags) {
    if (!PyTuple_CheckExact(args)) throw KeepFallback();
    func_ = func;
    Ref a(map(args, -1));
    PyObject* k;
    if (kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0) {
      k = check(PyDict_New());
      Ref owned(k);
      Py_ssize_t pos = 0;
      PyObject *name, *v;
      while (PyDict_Next(kwargs, &pos, &name, &v)) {
        Ref m(map(v, 0));
        if (PyDict_SetItem(k, name, m.p) < 0) throw PythonError();
      }
      PyObject_GC_UnTrack(k);
      Py_INCREF(k);
    } else {
      k = Py_NewRef(empty_kwargs);
    }
    Ref kw(k);
    making_ = true;
    PyObject* o;
    try {
      o = map(out, kNoFloats);
    } catch (...) {
      making_ = false;
      throw;
    }
    making_ = false;
    Ref outs(o);
    Ref f(PyLong_FromLong(flags));
    Ref op(PyTuple_Pack(5, func, a.p, kw.p, outs.p, f.p));
    PyObject_GC_UnTrack(op.p);  // Note [kept objects untracked]
    if (PyList_Append(ops, op.p) < 0) throw PythonError();
    if (release && pending_.size() >= last_pending_ + kBatch) release_dead();
  }

  // Note [kept objects untracked]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // What the native walk makes for a kept op (the op tuple, its argument tuples, lists and
  // keyword dict, each new alias) is taken off the cyclic garbage collector's lists: they
  // hold only the op, scalars, our aliases (fresh tensors nothing else references) and the
  // program's tensor subclasses, so they can be in no cycle, and reference counting frees
  // them with the graph. A collection then never walks an emulated graph's kept objects:
  // each capture's young collections, and the full one a guard build triggers (the 0.9 s of
  // docs/performance.md), cost what they cost without emulated graphs.
  // A plain alias of `v` (an exact Tensor or Parameter) pinned to its storage, offset, size
  // and stride now; `v` itself where an alias cannot carry what it is. New reference.
  PyObject* pin(PyObject* v) {
    const at::Tensor& t = THPVariable_Unpack(v);
    if (t.layout() != c10::kStrided || t.is_quantized() || t.is_conj() || t.is_neg() ||
        t.is_nested() || !t.has_storage()) {
      return Py_NewRef(v);
    }
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    auto sizes = t.sizes();
    auto strides = t.strides();
    const size_t ndim = sizes.size();
    key_.resize(4 + 2 * ndim);  // written in place, as Writer::slot_of's
    int64_t* key = key_.data();
    key[0] = reinterpret_cast<int64_t>(impl);
    key[1] = static_cast<int64_t>(t.scalar_type());
    key[2] = t.storage_offset();
    key[3] = static_cast<int64_t>(ndim);
    std::memcpy(key + 4, sizes.data(), ndim * sizeof(int64_t));
    std::memcpy(key + 4 + ndim, strides.data(), ndim * sizeof(int64_t));
    auto it = aliases_.find(key_);
    if (it != aliases_.end()) return Py_NewRef(it->second);
    if (seen_.insert(impl).second && making_) {
      made_.emplace(impl, made_list_.size());
      pending_.push_back(made_list_.size());
      made_list_.push_back(Made{impl, {}, 0, false});
    }
    at::Tensor alias;
    if (t.is_inference()) {  // a normal tensor on its storage (inference_mode would make one)
      c10::InferenceMode normal(false);
      auto made = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(),
                                                       t.dtype());
      made->set_sizes_and_strides(sizes, strides, t.storage_offset());
      alias = at::Tensor(std::move(made));
    } else {  // what t.detach() makes
      c10::TensorImpl* src = t.unsafeGetTensorImpl();
      alias = at::Tensor(src->shallow_copy_and_detach(src->version_counter(),
                                                      /*allow_tensor_metadata_change=*/true));
    }
    PyObject* py = check(THPVariable_Wrap(std::move(alias)));
    PyObject_GC_UnTrack(py);
    aliases_.emplace(key_, py);
    auto m = made_.find(impl);
    if (m != made_.end()) made_list_[m->second].aliases.emplace_back(key_, py);
    return Py_NewRef(py);
  }

  void set_making(bool making) { making_ = making; }

  // End of capture: with `release`, the storages made in the region that only our aliases
  // hold become scratch (those not found dead as the capture went). The alias map goes.
  void seal(bool release_now) {
    if (release_now) {
      for (auto& m : made_list_) {
        if (!m.done && unheld(m)) to_scratch(m);
      }
    }
    clear_aliases();
  }

  // Before a replay: each scratch storage afresh, its aliases on it at their views.
  void lend() {
    for (auto& s : scratch_) {
      c10::DeviceGuard guard(s.device);
      c10::Storage fresh(c10::Storage::use_byte_size_t(), s.nbytes,
                         c10::GetAllocator(s.device.type()), /*resizable=*/true);
      for (auto& l : s.lent) {
        c10::TensorImpl* ti = THPVariable_Unpack(l.alias).unsafeGetTensorImpl();
        ti->set_storage_keep_dtype(fresh);
        ti->set_sizes_and_strides(l.sizes, l.strides, l.offset);
      }
    }
  }

  // After a replay: the scratch aliases emptied again (their storages freed).
  void reclaim() {
    for (auto& s : scratch_) {
      for (auto& l : s.lent) empty_out(THPVariable_Unpack(l.alias).unsafeGetTensorImpl(), s.device);
    }
  }


 private:
  struct Lent {
    PyObject* alias;  // owned
    int64_t offset;
    std::vector<int64_t> sizes, strides;
  };
  struct Scratch {
    size_t nbytes;
    c10::Device device;
    std::vector<Lent> lent;
  };
  struct Made {  // a storage first pinned as an op's output
    c10::StorageImpl* impl;
    std::vector<std::pair<std::vector<int64_t>, PyObject*>> aliases;  // key, alias (aliases_')
    int checks;
    bool done;  // scratch already
  };
  // A storage made in the region is looked at as the capture goes, after every kBatch new
  // ones, at most kChecks times (what outlives that waits for seal): one that only the
  // graph's aliases hold is unreachable by the program, so it is scratch already, and its
  // memory goes back to the allocator while the capture runs, as it would without a graph.
  static constexpr size_t kBatch = 32;
  static constexpr int kChecks = 2;

  // Only our aliases hold the storage: each alias's TensorImpl once, and its Python object
  // (an UntypedStorage) once when nothing but the storage itself keeps that object.
  bool unheld(const Made& m) const {
    c10::StorageImpl* impl = m.impl;
    PyObject* wrapper = impl->pyobj_slot()->load_pyobj();
    const size_t own = m.aliases.size() + (wrapper != nullptr && Py_REFCNT(wrapper) == 1);
    return c10::raw::intrusive_ptr::use_count(impl) <= own;
  }

  void release_dead() {
    size_t w = 0;
    for (size_t i : pending_) {
      Made& m = made_list_[i];
      if (m.done) continue;
      if (unheld(m)) {
        to_scratch(m);
      } else if (++m.checks < kChecks) {
        pending_[w++] = i;
      }
    }
    pending_.resize(w);
    last_pending_ = w;
  }

  const c10::Storage& empty_for(c10::Device device) {
    for (auto& e : empties_)
      if (e.first == device) return e.second;
    empties_.emplace_back(device, c10::Storage(c10::Storage::use_byte_size_t(), 0,
                                               c10::DataPtr(nullptr, device), nullptr, false));
    return empties_.back().second;
  }

  void empty_out(c10::TensorImpl* ti, c10::Device device) {
    ti->set_storage_keep_dtype(empty_for(device));
    ti->set_sizes_contiguous({0});
    ti->set_storage_offset(0);
  }

  // The storage's aliases emptied in place (their views kept in a Scratch); the storage is
  // freed with the last of them. The aliases leave the alias map (the address may be reused).
  void to_scratch(Made& m) {
    c10::StorageImpl* impl = m.impl;
    Scratch s{impl->nbytes(), impl->device(), {}};
    s.lent.reserve(m.aliases.size());
    for (auto& ka : m.aliases) {
      c10::TensorImpl* ti = THPVariable_Unpack(ka.second).unsafeGetTensorImpl();
      s.lent.push_back(Lent{ka.second, ti->storage_offset(), ti->sizes().vec(),
                            ti->strides().vec()});  // the map's reference, moved here
      aliases_.erase(ka.first);
    }
    seen_.erase(impl);
    made_.erase(impl);
    m.done = true;
    m.aliases.clear();
    m.aliases.shrink_to_fit();
    for (auto& l : s.lent) empty_out(THPVariable_Unpack(l.alias).unsafeGetTensorImpl(), s.device);
    scratch_.push_back(std::move(s));
  }

  static bool is_leaf(PyObject* v) {
    return is_scalar(v) || PyComplex_CheckExact(v) || THPDtype_Check(v) || THPDevice_Check(v) ||
        THPLayout_Check(v) || THPMemoryFormat_Check(v) || Py_TYPE(v) == &THPSizeType;
  }

  // `v` with every plain tensor pinned (tracing.map_tensors' shapes, less what goes to Python).
  // Floats at `depth` 0 to 2 (an argument, in a list, in a nested list: scalars.floats_in)
  // go into `floats` on the way; the args tuple itself is depth -1.
  static constexpr int kNoFloats = 1 << 20;
  PyObject* map(PyObject* v, int depth) {
    if (THPVariable_CheckExact(v)) return pin(v);
    if (THPVariable_Check(v)) return Py_NewRef(v);  // a subclass: kept whole, as _pin does
    if (PyFloat_CheckExact(v)) {
      const double x = PyFloat_AS_DOUBLE(v);
      if (depth <= 2 && x == x && PyDict_SetDefault(floats, v, func_) == nullptr) {
        throw PythonError();
      }
      return Py_NewRef(v);
    }
    if (is_leaf(v)) return Py_NewRef(v);
    const bool is_tuple = PyTuple_CheckExact(v);
    if (!is_tuple && !PyList_CheckExact(v)) throw KeepFallback();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject* mapped = check(is_tuple ? PyTuple_New(n) : PyList_New(n));
    Ref owned(mapped);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = map(PySequence_Fast_GET_ITEM(v, i), depth + 1);
      if (is_tuple) PyTuple_SET_ITEM(mapped, i, item);
      else PyList_SET_ITEM(mapped, i, item);
    }
    PyObject_GC_UnTrack(mapped);
    return Py_NewRef(mapped);
  }

  void clear_aliases() {
    for (auto& kv : aliases_) Py_DECREF(kv.second);
    aliases_.clear();
    seen_.clear();
    made_.clear();
    made_list_.clear();
    pending_.clear();
    last_pending_ = 0;
  }

  bool making_ = false;
  PyObject* func_ = nullptr;  // the op being kept (borrowed, during keep)
  std::vector<int64_t> key_;  // (StorageImpl, dtype, offset, ndim, sizes..., strides...)
  ska::flat_hash_map<std::vector<int64_t>, PyObject*, KeyHash> aliases_;  // key -> alias (owned)
  ska::flat_hash_set<const void*> seen_;          // storages pinned so far
  ska::flat_hash_map<const void*, size_t> made_;  // of those, first as outputs -> made_list_
  std::vector<Made> made_list_;
  std::vector<size_t> pending_;  // made_list_ entries still to look at as the capture goes
  size_t last_pending_ = 0;      // pending_'s size after the last look
  std::vector<Scratch> scratch_;
  std::vector<std::pair<c10::Device, c10::Storage>> empties_;  // a 0-byte storage per device
};

struct KeeperObject {
  PyObject_HEAD
  Keeper* keeper;
};

PyTypeObject KeeperType = {PyVarObject_HEAD_INIT(nullptr, 0)};

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
  PyObject* keeper_obj = nullptr;   // a Keeper (owned) while the capture keeps an emulated graph
  Keeper* keeper = nullptr;
  bool ops_is_array = false;        // ops_arr is an array.array: its length is Py_SIZE

  ~Writer() {
    Py_XDECREF(keeper_obj);
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
    // An array.array's length is its ob_size: read in place (the Python writer's fallback
    // appends to the same array, so it is read per op, not counted here).
    Py_ssize_t flushed = ops_is_array ? Py_SIZE(ops_arr) : PyObject_Length(ops_arr);
    if (flushed < 0) throw PythonError();
    if (ops_.capacity() == 0) take_buffers();
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
    give_back(ops_, table->spare_ops);
    give_back(modules_, table->spare_modules);
    give_back(rows_, table->spare_rows);
  }

 private:
  ska::flat_hash_map<PyObject*, Plan> plans_;
  std::vector<int64_t> key_;  // the view being looked up: (dtype, offset, ndim, sizes, strides)
  std::vector<int64_t> inputs_;
  std::vector<int32_t> ops_, modules_;
  std::vector<int64_t> rows_;

  // arr.frombytes(a read-only view of `data`): copied once, into the array.
  static void extend(PyObject* arr, const void* data, size_t n) {
    static PyObject* s_frombytes = PyUnicode_InternFromString("frombytes");
    if (s_frombytes == nullptr) throw PythonError();
    Ref view(PyMemoryView_FromMemory(const_cast<char*>(static_cast<const char*>(data)),
                                     static_cast<Py_ssize_t>(n), PyBUF_READ));
    Ref r(PyObject_CallMethodOneArg(arr, s_frombytes, view.p));
  }

  // Note [record buffers reused]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A writer buffers its rows in vectors until a flush copies them into the capture's arrays.
  // Grown from empty in every capture, they were reallocated a dozen times each and written
  // to fresh memory (page faults, cache misses: docs/performance.md, "A third pass"). So a
  // flush hands the emptied vectors to the trace's table and the next op recorded by any of
  // its writers takes them: a capture like the last grows none, in memory already paged in.
  // They hold integers only (never a storage), and the table keeps at most the largest
  // capture's buffers (counted in `memory()`), freed with it.
  template <typename T>
  static void give_back(std::vector<T>& mine, std::vector<T>& spare) {
    mine.clear();
    if (mine.capacity() >= spare.capacity()) {
      spare = std::move(mine);
      mine = std::vector<T>();
    }
  }

  template <typename T>
  static void take(std::vector<T>& mine, std::vector<T>& spare) {
    if (spare.capacity() > mine.capacity()) {
      mine = std::move(spare);
      spare = std::vector<T>();
    }
  }

  void take_buffers() {
    take(ops_, table->spare_ops);
    take(modules_, table->spare_modules);
    take(rows_, table->spare_rows);
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
    const size_t ndim = sizes.size();
    const size_t n = 3 + 2 * ndim;
    key_.resize(n);  // written in place: no reallocation once the longest key was seen
    int64_t* key = key_.data();
    key[0] = static_cast<int64_t>(t.scalar_type());
    key[1] = t.storage_offset();
    key[2] = static_cast<int64_t>(ndim);
    std::memcpy(key + 3, sizes.data(), ndim * sizeof(int64_t));
    std::memcpy(key + 3 + ndim, strides.data(), ndim * sizeof(int64_t));
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
  w->ops_is_array = w->ops_arr != nullptr &&
      std::strcmp(Py_TYPE(w->ops_arr)->tp_name, "array.array") == 0;
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

// Keep a recorded op into the writer's Keeper (Note [native keep]); `flags` is what the
// record returned. False with a Python error set.
bool keep_op(Writer* w, PyObject* const* args, PyObject* flags) {
  const long f = PyLong_AsLong(flags);
  if (f == -1 && PyErr_Occurred()) return false;
  if (f == 0) return true;  // a pure view: a graph bakes it in and never re-runs it
  try {
    w->keeper->keep(args[0], args[1], args[2], args[3], static_cast<int>(f));
    return true;
  } catch (const PythonError&) {
    return false;
  } catch (const KeepFallback&) {
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return false;
  }
  PyObject* call[6] = {w->keeper_obj, args[0], args[1], args[2], args[3], flags};
  PyObject* r = PyObject_Vectorcall(w->keeper->slow, call, 6, nullptr);
  if (r == nullptr) return false;
  Py_DECREF(r);
  return true;
}

PyObject* Writer_record(PyWriterObject* self, PyObject* const* args, Py_ssize_t nargs) {
  Writer* w = writer_of(self);
  if (w == nullptr) return nullptr;
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "record(func, args, kwargs, out) takes 4 arguments");
    return nullptr;
  }
  const size_t n_ops = w->n_ops(), n_rows = w->n_rows();
  PyObject* flags = nullptr;
  try {
    flags = check(PyLong_FromLong(w->record(args[0], args[1], args[2], args[3])));
  } catch (const PythonError&) {
    w->rollback(n_ops, n_rows);
    return nullptr;
  } catch (const Fallback&) {
  } catch (const std::exception&) {  // c10::Error: symbolic shapes, no storage, ...
  }
  if (flags == nullptr) {
    // The Python writer handles this op (and reports what it cannot): rows stay in order.
    w->rollback(n_ops, n_rows);
    try {
      w->flush();
    } catch (const PythonError&) {
      return nullptr;
    }
    flags = PyObject_Vectorcall(w->fallback, args, 4, nullptr);
    if (flags == nullptr) return nullptr;
  }
  if (w->keeper != nullptr && !keep_op(w, args, flags)) {  // rows stay: the op ran
    Py_DECREF(flags);
    return nullptr;
  }
  return flags;
}

PyObject* Writer_set_keeper(PyWriterObject* self, PyObject* arg) {
  Writer* w = writer_of(self);
  if (w == nullptr) return nullptr;
  if (arg != Py_None && Py_TYPE(arg) != &KeeperType) {
    PyErr_SetString(PyExc_TypeError, "set_keeper(a native Keeper or None)");
    return nullptr;
  }
  Py_XDECREF(w->keeper_obj);
  w->keeper_obj = arg == Py_None ? nullptr : Py_NewRef(arg);
  w->keeper = arg == Py_None ? nullptr : reinterpret_cast<KeeperObject*>(arg)->keeper;
  Py_RETURN_NONE;
}

// --------------------------------------------------------------------------- Keeper type

PyObject* Keeper_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  PyObject* slow;
  int release = 1;
  static const char* names[] = {"slow", "release", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p", const_cast<char**>(names), &slow,
                                   &release)) {
    return nullptr;
  }
  if (!PyCallable_Check(slow)) {
    PyErr_SetString(PyExc_TypeError, "Keeper(slow): slow must be callable");
    return nullptr;
  }
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  auto* k = new Keeper();
  reinterpret_cast<KeeperObject*>(self)->keeper = k;
  k->slow = Py_NewRef(slow);
  k->release = release;
  k->ops = PyList_New(0);
  k->empty_kwargs = PyDict_New();
  k->floats = PyDict_New();
  if (k->ops == nullptr || k->empty_kwargs == nullptr || k->floats == nullptr) {
    Py_DECREF(self);
    return nullptr;
  }
  return self;
}

void Keeper_dealloc(KeeperObject* self) {
  delete self->keeper;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* Keeper_pin(KeeperObject* self, PyObject* const* a, Py_ssize_t n) {
  if (n != 2 || !THPVariable_CheckExact(a[0])) {
    PyErr_SetString(PyExc_TypeError, "pin(tensor, making): a plain Tensor or Parameter");
    return nullptr;
  }
  const int making = PyObject_IsTrue(a[1]);
  if (making < 0) return nullptr;
  Keeper* k = self->keeper;
  k->set_making(making);
  try {
    PyObject* r = k->pin(a[0]);
    k->set_making(false);
    return r;
  } catch (const PythonError&) {
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  k->set_making(false);
  return nullptr;
}

// Run a Keeper method that returns nothing: a C++ exception becomes a RuntimeError
template <typename F>
PyObject* keeper_call(F&& call) {
  try {
    call();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* Keeper_seal(KeeperObject* self, PyObject* arg) {
  const int release = PyObject_IsTrue(arg);
  if (release < 0) return nullptr;
  return keeper_call([&] { self->keeper->seal(release); });
}

PyObject* Keeper_lend(KeeperObject* self, PyObject*) {
  return keeper_call([&] { self->keeper->lend(); });
}

PyObject* Keeper_reclaim(KeeperObject* self, PyObject*) {
  return keeper_call([&] { self->keeper->reclaim(); });
}

PyObject* Keeper_get_ops(KeeperObject* self, void*) {
  return Py_NewRef(self->keeper->ops);
}

PyMethodDef keeper_methods[] = {
    {"pin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Keeper_pin)),
     METH_FASTCALL, "pin(tensor, making) -> its alias (Note [native keep])"},
    {"seal", reinterpret_cast<PyCFunction>(Keeper_seal), METH_O,
     "seal(release): end of capture; with release, unheld storages made in it become scratch"},
    {"lend", reinterpret_cast<PyCFunction>(Keeper_lend), METH_NOARGS,
     "before a replay: fresh storages under the scratch aliases"},
    {"reclaim", reinterpret_cast<PyCFunction>(Keeper_reclaim), METH_NOARGS,
     "after a replay: the scratch aliases emptied again"},
    {nullptr, nullptr, 0, nullptr}};

PyObject* Keeper_get_floats(KeeperObject* self, void*) {
  return Py_NewRef(self->keeper->floats);
}

PyGetSetDef keeper_getset[] = {
    {"floats", reinterpret_cast<getter>(Keeper_get_floats), nullptr,
     "each float the kept ops take (scalars.floats_in) -> the first op taking it", nullptr},
    {"ops", reinterpret_cast<getter>(Keeper_get_ops), nullptr,
     "the kept ops: (func, args, kwargs, out, replay flags) each", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

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

// Does `t` have exactly the geometry `view` gives, a (dtype, sizes, strides, storage offset)
// tuple (graphtrace.verdict.View)? 1 yes, 0 no, -1 an error set (`view` malformed).
int same_geometry(const at::Tensor& t, PyObject* view) {
  if (!PyTuple_Check(view) || PyTuple_GET_SIZE(view) != 4 ||
      !PyTuple_Check(PyTuple_GET_ITEM(view, 1)) || !PyTuple_Check(PyTuple_GET_ITEM(view, 2))) {
    PyErr_SetString(PyExc_TypeError, "paths_moved: a view is (dtype, sizes, strides, offset)");
    return -1;
  }
  if (PyTuple_GET_ITEM(view, 0) != reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())))
    return 0;
  // the sizes and strides as they are stored: a symbolic one (no concrete value) is not
  // compared here, Python decides
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return 0;
  const auto ints_equal = [](PyObject* tuple, c10::IntArrayRef want) {
    if (PyTuple_GET_SIZE(tuple) != static_cast<Py_ssize_t>(want.size())) return 0;
    for (size_t d = 0; d < want.size(); ++d) {
      const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, static_cast<Py_ssize_t>(d)));
      if (v == -1 && PyErr_Occurred()) return -1;
      if (v != want[d]) return 0;
    }
    return 1;
  };
  int same = ints_equal(PyTuple_GET_ITEM(view, 1), t.sizes());
  if (same != 1) return same;
  same = ints_equal(PyTuple_GET_ITEM(view, 2), t.strides());
  if (same != 1) return same;
  const long long offset = PyLong_AsLongLong(PyTuple_GET_ITEM(view, 3));
  if (offset == -1 && PyErr_Occurred()) return -1;
  return offset == t.storage_offset() ? 1 : 0;
}

// Owner paths still reaching the storages they reached (graphtrace.owners.PathSet.moved),
// followed as graphtrace.owners._step does: an attribute of an nn.Module from its registries
// (`_parameters`, `_buffers`, `_modules`), then its `__dict__`; of another object from its
// `__dict__`, then getattr; a key of a dict or an index of a list or tuple. Anything else
// (closures, dict subclasses, a getattr that raises, ...) is left undecided, for Python, as are
// leaves that are not plain tensors or Parameters. `nodes` is a list of (parent node or -1,
// step, is_key), parents first; `leaves` the node of each path; `expected` the StorageImpl
// address each reached. Returns True when a decided leaf now reaches another storage (or
// none), else the list of undecided path positions. An `expected` entry that is a float is a
// value the leaf must equal, as a float (a baked scalar's holder: graphtrace/guard/blind.py).
PyObject* paths_moved(PyObject*, PyObject* const* a, Py_ssize_t n) {
  // an optional 7th argument `versions`: per leaf the version counter the tensor it reaches
  // must have (None: not compared); a different one counts as moved (graphtrace/guard/check.py,
  // Note [guard freshness fast path]). An optional 8th, `views`: per leaf the geometry the
  // tensor had, (dtype, sizes, strides, storage offset), or None; a leaf on its storage under
  // any other geometry is left undecided, for Python's exact rule (Note [re-laid views] in
  // graphtrace/verdict.py: strides of length-one dimensions do not count there)
  auto same_length = [&](Py_ssize_t k) {
    return n <= k || a[k] == Py_None ||
        (PyList_Check(a[k]) && PyList_GET_SIZE(a[k]) == PyList_GET_SIZE(a[4]));
  };
  if (n < 6 || n > 8 || !PyType_Check(a[1]) || !PyType_Check(a[2]) || !PyList_Check(a[3]) ||
      !PyList_Check(a[4]) || !PyList_Check(a[5]) ||
      PyList_GET_SIZE(a[4]) != PyList_GET_SIZE(a[5]) || !same_length(6) || !same_length(7)) {
    PyErr_SetString(PyExc_TypeError,
                    "paths_moved(model, module_type, parameter_type, nodes, leaves, expected"
                    "[, versions[, views]])");
    return nullptr;
  }
  PyObject* versions = n >= 7 && a[6] != Py_None ? a[6] : nullptr;
  PyObject* views = n == 8 && a[7] != Py_None ? a[7] : nullptr;
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
  // path j is left for Python to decide; false (undecided released) on an error
  auto leave_undecided = [undecided](Py_ssize_t j) {
    PyObject* index = PyLong_FromSsize_t(j);
    if (index == nullptr || PyList_Append(undecided, index) < 0) {
      Py_XDECREF(index);
      Py_DECREF(undecided);
      return false;
    }
    Py_DECREF(index);
    return true;
  };
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(leaves); ++j) {
    const Py_ssize_t leaf = PyLong_AsSsize_t(PyList_GET_ITEM(leaves, j));
    if (leaf == -1 && PyErr_Occurred()) {
      Py_DECREF(undecided);
      return nullptr;
    }
    PyObject* obj = leaf >= 0 && leaf < m ? objs[leaf] : nullptr;
    PyObject* value = PyList_GET_ITEM(expected, j);
    if (PyFloat_CheckExact(value)) {  // a float baseline (a baked scalar's holder): by value
      if (obj == nullptr || !PyFloat_CheckExact(obj)) {
        if (!leave_undecided(j)) return nullptr;
      } else if (PyFloat_AS_DOUBLE(obj) != PyFloat_AS_DOUBLE(value)) {
        Py_DECREF(undecided);
        Py_RETURN_TRUE;
      }
      continue;
    }
    if (obj == nullptr || !(is_exact_tensor(obj) || Py_TYPE(obj) == parameter_type)) {
      if (!leave_undecided(j)) return nullptr;
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
    PyObject* version = versions == nullptr ? Py_None : PyList_GET_ITEM(versions, j);
    if (version != Py_None) {
      if (t.is_inference()) {  // no version counter: Python decides
        if (!leave_undecided(j)) return nullptr;
        continue;
      }
      const long long v = PyLong_AsLongLong(version);
      if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(undecided);
        return nullptr;
      }
      if (static_cast<long long>(t._version()) != v) {
        Py_DECREF(undecided);
        Py_RETURN_TRUE;
      }
    }
    PyObject* view = views == nullptr ? Py_None : PyList_GET_ITEM(views, j);
    if (view != Py_None) {
      const int same = same_geometry(t, view);
      if (same < 0) {
        Py_DECREF(undecided);
        return nullptr;
      }
      if (same == 0 && !leave_undecided(j)) return nullptr;
    }
  }
  return undecided;
}

// graphtrace.owners.named_modules in C++ (for the baked-scalar match at each emulated
// capture's end, where the Python loop was most of its time): [(prefix, module)] of `model`
// and every module under it through `_modules`, depth first in registration order, a module
// reached twice by different names listed twice, and one already on the path from the root
// (a cycle) not entered again. The listed modules keep each other alive while the list is
// built, so their addresses stand for them on the path.
PyObject* named_modules(PyObject*, PyObject* model) {
  static PyObject* s_modules = PyUnicode_InternFromString("_modules");
  static PyObject* s_dot = PyUnicode_InternFromString(".");
  if (s_modules == nullptr || s_dot == nullptr) return nullptr;
  struct Item {
    PyObject* module;  // new reference; nullptr: leave the module entered last
    PyObject* prefix;  // new reference
  };
  std::vector<Item> todo;
  std::vector<PyObject*> path;  // entered modules, root first (held by `out`)
  PyObject* out = PyList_New(0);
  PyObject* root_prefix = PyUnicode_FromString("");
  if (out == nullptr || root_prefix == nullptr) {
    Py_XDECREF(out);
    Py_XDECREF(root_prefix);
    return nullptr;
  }
  todo.push_back({Py_NewRef(model), root_prefix});
  bool ok = true;
  while (ok && !todo.empty()) {
    Item it = todo.back();
    todo.pop_back();
    if (it.module == nullptr) {
      path.pop_back();
      continue;
    }
    if (std::find(path.begin(), path.end(), it.module) != path.end()) {
      Py_DECREF(it.module);
      Py_DECREF(it.prefix);
      continue;
    }
    PyObject* pair = PyTuple_Pack(2, it.prefix, it.module);
    ok = pair != nullptr && PyList_Append(out, pair) == 0;
    Py_XDECREF(pair);
    PyObject* children = ok ? PyObject_GetAttr(it.module, s_modules) : nullptr;
    PyObject* items = children != nullptr ? PyMapping_Items(children) : nullptr;
    ok = items != nullptr;
    if (ok) {
      path.push_back(it.module);  // `out` holds it from here on
      todo.push_back({nullptr, nullptr});
      for (Py_ssize_t j = PyList_GET_SIZE(items) - 1; ok && j >= 0; --j) {
        PyObject* entry = PyList_GET_ITEM(items, j);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
          PyErr_SetString(PyExc_TypeError, "named_modules: _modules.items() gave a non-pair");
          ok = false;
          break;
        }
        PyObject* child = PyTuple_GET_ITEM(entry, 1);
        if (child == Py_None) continue;
        PyObject* name = PyTuple_GET_ITEM(entry, 0);
        PyObject* prefix;
        if (PyUnicode_GET_LENGTH(it.prefix) == 0) {
          prefix = PyUnicode_Check(name) ? Py_NewRef(name) : nullptr;
          if (prefix == nullptr) PyErr_SetString(PyExc_TypeError, "module names are str");
        } else {
          PyObject* dotted = PyUnicode_Concat(it.prefix, s_dot);
          prefix = dotted != nullptr ? PyUnicode_Concat(dotted, name) : nullptr;
          Py_XDECREF(dotted);
        }
        ok = prefix != nullptr;
        if (ok) todo.push_back({Py_NewRef(child), prefix});
      }
    }
    Py_XDECREF(items);
    Py_XDECREF(children);
    Py_DECREF(it.module);
    Py_DECREF(it.prefix);
  }
  for (Item& it : todo) {  // left after an error
    Py_XDECREF(it.module);
    Py_XDECREF(it.prefix);
  }
  if (!ok) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

// The floats modules hold (graphtrace.owners.scalar_owners: the baked-scalar match at each
// emulated capture's end, Note [baked scalars] in graphtrace/scalars.py), without a Python
// frame per attribute: for each (prefix, module) of `modules`, each entry of the module's
// __dict__ whose key is an identifier (an exact str) not in `internals`, and whose value is
// a float (in `values`, unless it is None) or a dict of 1 to 64 entries, whose float values
// (in `values`) count one by one. Returns (prefix, name, value, False, None) per attribute and
// (prefix, name, value, True, key) per dict entry, in the dicts' order; Python spells the
// paths (and which keys have one). References are taken on what is looked at, since a
// comparison inside `values` may run Python code.
PyObject* float_holders(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 3 || !PyList_Check(a[0]) || !PyAnySet_Check(a[1]) ||
      (a[2] != Py_None && !PyAnySet_Check(a[2]) && !PyDict_Check(a[2]))) {
    PyErr_SetString(PyExc_TypeError,
                    "float_holders(modules: list of (prefix, module), internals: set, "
                    "values: set, dict or None)");
    return nullptr;
  }
  PyObject *modules = a[0], *internals = a[1], *values = a[2] == Py_None ? nullptr : a[2];
  // 1: keep `x`, 0: skip it, -1: an error
  auto wanted = [values](PyObject* x) -> int {
    if (!PyFloat_CheckExact(x)) return 0;
    return values == nullptr ? 1 : PySequence_Contains(values, x);
  };
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  auto add = [out](PyObject* prefix, PyObject* name, PyObject* value, bool entry,
                   PyObject* key) -> bool {
    PyObject* row = PyTuple_Pack(5, prefix, name, value, entry ? Py_True : Py_False,
                                 key == nullptr ? Py_None : key);
    if (row == nullptr) return false;
    const int rc = PyList_Append(out, row);
    Py_DECREF(row);
    return rc == 0;
  };
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(modules); ++i) {
    PyObject* item = PyList_GET_ITEM(modules, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
      Py_DECREF(out);
      PyErr_SetString(PyExc_TypeError, "float_holders: modules holds (prefix, module) pairs");
      return nullptr;
    }
    PyObject* prefix = PyTuple_GET_ITEM(item, 0);
    PyObject* d = PyObject_GenericGetDict(PyTuple_GET_ITEM(item, 1), nullptr);
    if (d == nullptr) {  // no __dict__: no attributes to hold a float
      PyErr_Clear();
      continue;
    }
    if (!PyDict_Check(d)) {  // a __dict__ that is not a dict: nothing read from it
      Py_DECREF(d);
      continue;
    }
    bool ok = true;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (ok && PyDict_Next(d, &pos, &k, &v)) {
      const bool is_float = PyFloat_CheckExact(v);
      if (!is_float && !(PyDict_CheckExact(v) && PyDict_GET_SIZE(v) > 0 &&
                         PyDict_GET_SIZE(v) <= 64)) {
        continue;
      }
      if (!PyUnicode_CheckExact(k) || PyUnicode_IsIdentifier(k) != 1) continue;
      const int internal = PySet_Contains(internals, k);
      if (internal != 0) {
        ok = internal > 0;
        continue;
      }
      Py_INCREF(k);
      Py_INCREF(v);
      if (is_float) {
        const int keep = wanted(v);
        ok = keep >= 0 && (keep == 0 || add(prefix, k, v, false, nullptr));
      } else {
        Py_ssize_t inner = 0;
        PyObject *key, *x;
        while (ok && PyDict_Next(v, &inner, &key, &x)) {
          if (!PyFloat_CheckExact(x)) continue;
          Py_INCREF(key);
          Py_INCREF(x);
          const int keep = wanted(x);
          ok = keep >= 0 && (keep == 0 || add(prefix, k, x, true, key));
          Py_DECREF(key);
          Py_DECREF(x);
        }
      }
      Py_DECREF(k);
      Py_DECREF(v);
    }
    Py_DECREF(d);
    if (!ok) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
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

// --------------------------------------------------------------------------- module calls

// Note [native module call]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// graphtrace.attribution's one-frame module call (Note [one frame per module call] there), run
// in C. A watched module's instance `_call_impl` is a Python function (`call`'s code, the
// module's values in its closure cells) bound to it; `set_native_call` sets that function's
// vectorcall to `module_call` below (PEP 590; `PyFunction_SetVectorcall` from Python 3.12),
// so calling it runs no Python frame, while Dynamo, which reads a function's bytecode and
// never calls it while it traces, still inlines the Python `call`. `module_call` does what
// `call` does: on `nn.Module._call_impl`'s fast path -- no hooks on the module or global, no
// JIT tracing, the module's `forward` still the wrapper in the cells, its class's `_call_impl`
// and `forward` still those `call` was made for -- it pushes the module's FQN id on the
// thread's module stack, calls the class forward with the very argument array it was given
// (the module first) and pops; otherwise it hands the call to the class's `_call_impl`. It
// skips `call`'s Dynamo check: Dynamo never runs it.
PyObject* call_stack_holder = nullptr;  // graphtrace.recorder.module_stack (thread-local)
PyObject* call_global_hooks[4] = {nullptr, nullptr, nullptr, nullptr};
PyObject* call_impl = nullptr;  // nn.Module._call_impl
Py_ssize_t call_cells = -1;     // how many closure cells `call` has
Py_ssize_t cell_fid = -1, cell_wrapper = -1, cell_cls_forward = -1;  // which is which

// configure_calls(module_stack, (4 global hook dicts), Module._call_impl, (n cells, index of
// fid, of wrapper, of cls_forward))
PyObject* configure_calls(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 4 || !PyTuple_Check(a[1]) || PyTuple_GET_SIZE(a[1]) != 4 || !PyTuple_Check(a[3]) ||
      PyTuple_GET_SIZE(a[3]) != 4) {
    PyErr_SetString(PyExc_TypeError,
                    "configure_calls(module_stack, (4 global hook dicts), Module._call_impl, "
                    "(cells, fid, wrapper, cls_forward))");
    return nullptr;
  }
  Py_ssize_t cells[4];
  for (Py_ssize_t i = 0; i < 4; ++i) {
    if (!PyDict_Check(PyTuple_GET_ITEM(a[1], i))) {
      PyErr_SetString(PyExc_TypeError, "configure_calls: the global hooks must be dicts");
      return nullptr;
    }
    cells[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(a[3], i));
    if (cells[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  for (Py_ssize_t i = 1; i < 4; ++i) {
    if (cells[i] < 0 || cells[i] >= cells[0]) {
      PyErr_SetString(PyExc_ValueError, "configure_calls: a cell index out of range");
      return nullptr;
    }
  }
  Py_XSETREF(call_stack_holder, Py_NewRef(a[0]));
  for (Py_ssize_t i = 0; i < 4; ++i)
    Py_XSETREF(call_global_hooks[i], Py_NewRef(PyTuple_GET_ITEM(a[1], i)));
  Py_XSETREF(call_impl, Py_NewRef(a[2]));
  call_cells = cells[0];
  cell_fid = cells[1];
  cell_wrapper = cells[2];
  cell_cls_forward = cells[3];
  Py_RETURN_NONE;
}

// Whether a hook table attribute of the module holds anything: 1, 0, -1 not a dict, -2 error
int hooks_set(PyObject* dict, PyObject* name) {
  PyObject* hooks = PyDict_GetItemWithError(dict, name);  // borrowed
  if (hooks == nullptr) return PyErr_Occurred() ? -2 : -1;
  if (!PyDict_Check(hooks)) return -1;
  return PyDict_GET_SIZE(hooks) != 0;
}

// The class's `_call_impl` with the same arguments (the module first)
PyObject* hand_over(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static PyObject* s_call_impl = PyUnicode_InternFromString("_call_impl");
  PyObject* impl = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(self)), s_call_impl);
  if (impl == nullptr) return nullptr;
  PyObject* out = PyObject_Vectorcall(impl, args, nargs, kwnames);
  Py_DECREF(impl);
  return out;
}

PyObject* module_call(PyObject* fn, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  static PyObject* s_stack = PyUnicode_InternFromString("stack");
  static PyObject* s_call_impl = PyUnicode_InternFromString("_call_impl");
  static PyObject* s_forward = PyUnicode_InternFromString("forward");
  static PyObject* s_hooks[4] = {
      PyUnicode_InternFromString("_forward_pre_hooks"),
      PyUnicode_InternFromString("_forward_hooks"),
      PyUnicode_InternFromString("_backward_pre_hooks"),
      PyUnicode_InternFromString("_backward_hooks")};
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "graphtrace: a module call needs the module");
    return nullptr;
  }
  PyObject* self = args[0];
  PyObject* closure = PyFunction_GET_CLOSURE(fn);  // set_native_call checked its size
  PyObject* fid = PyCell_GET(PyTuple_GET_ITEM(closure, cell_fid));
  PyObject* wrapper = PyCell_GET(PyTuple_GET_ITEM(closure, cell_wrapper));
  PyObject* cls_forward = PyCell_GET(PyTuple_GET_ITEM(closure, cell_cls_forward));
  if (fid == nullptr || wrapper == nullptr || cls_forward == nullptr)
    return hand_over(self, args, nargs, kwnames);
  PyObject* dict = PyObject_GenericGetDict(self, nullptr);
  if (dict == nullptr) return nullptr;
  bool fast = true;
  for (int i = 0; fast && i < 4; ++i) {
    int set = hooks_set(dict, s_hooks[i]);
    if (set == -2) {
      Py_DECREF(dict);
      return nullptr;
    }
    fast = set == 0;
  }
  for (int i = 0; fast && i < 4; ++i) fast = PyDict_GET_SIZE(call_global_hooks[i]) == 0;
  if (fast) {
    PyObject* mine = PyDict_GetItemWithError(dict, s_forward);  // borrowed
    fast = mine == wrapper && !torch::jit::tracer::isTracing() &&
           _PyType_Lookup(Py_TYPE(self), s_call_impl) == call_impl &&
           _PyType_Lookup(Py_TYPE(self), s_forward) == cls_forward;
  }
  Py_DECREF(dict);
  if (PyErr_Occurred()) return nullptr;
  if (!fast) return hand_over(self, args, nargs, kwnames);
  // the cells may change while the forward runs (a pause, a trace closing): hold what is used
  Py_INCREF(fid);
  Py_INCREF(cls_forward);
  PyObject* stack = PyObject_GetAttr(call_stack_holder, s_stack);
  if (stack == nullptr || !PyList_Check(stack) || PyList_Append(stack, fid) < 0) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "graphtrace: the module stack is not a list");
    Py_XDECREF(stack);
    Py_DECREF(fid);
    Py_DECREF(cls_forward);
    return nullptr;
  }
  PyObject* out = PyObject_Vectorcall(cls_forward, args, nargs, kwnames);
  Py_DECREF(cls_forward);
  Py_DECREF(fid);
  const Py_ssize_t depth = PyList_GET_SIZE(stack);
  if (depth > 0) {  // pop, as `call`'s `finally: stack.pop()`, keeping the forward's error
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (PyList_SetSlice(stack, depth - 1, depth, nullptr) < 0) {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
      Py_XDECREF(out);
      Py_DECREF(stack);
      return nullptr;
    }
    PyErr_Restore(type, value, tb);
  }
  Py_DECREF(stack);
  return out;
}

// set_native_call(fn): `fn` (a module's `call`, see above) runs as `module_call` from now on
PyObject* set_native_call(PyObject*, PyObject* fn) {
  if (call_stack_holder == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "set_native_call before configure_calls");
    return nullptr;
  }
  PyObject* closure = PyFunction_Check(fn) ? PyFunction_GET_CLOSURE(fn) : nullptr;
  if (closure == nullptr || !PyTuple_Check(closure) || PyTuple_GET_SIZE(closure) != call_cells) {
    PyErr_SetString(PyExc_TypeError, "set_native_call(fn): a module's `call` function");
    return nullptr;
  }
#if PY_VERSION_HEX >= 0x030C0000
  PyFunction_SetVectorcall(reinterpret_cast<PyFunctionObject*>(fn), module_call);
#else
  reinterpret_cast<PyFunctionObject*>(fn)->vectorcall = module_call;
#endif
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"configure_calls",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(configure_calls)),
     METH_FASTCALL,
     "configure_calls(module_stack, (4 global hook dicts), Module._call_impl, (cells, fid, "
     "wrapper, cls_forward)): what set_native_call's functions read"},
    {"set_native_call", reinterpret_cast<PyCFunction>(set_native_call), METH_O,
     "set_native_call(fn): a module's `call` runs in C from now on "
     "(Note [native module call] in graphtrace/csrc/recorder.cpp)"},
    {"configure", reinterpret_cast<PyCFunction>(configure), METH_O,
     "configure(cls): the class whose exact instances dispatch() calls through `_op` (None: none)"},
    {"paths_moved", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(paths_moved)),
     METH_FASTCALL,
     "paths_moved(model, module_type, parameter_type, nodes, leaves, expected[, versions[, views]]) -> "
     "True, or the undecided "
     "paths' positions (graphtrace.owners.PathSet.moved)"},
    {"named_modules", reinterpret_cast<PyCFunction>(named_modules), METH_O,
     "named_modules(model) -> [(prefix, module)] (graphtrace.owners.named_modules)"},
    {"float_holders",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(float_holders)),
     METH_FASTCALL,
     "float_holders(modules, internals, values) -> (prefix, name, value, is_entry, key) per "
     "float a module attribute (or a dict attribute's entry) holds "
     "(graphtrace.owners.scalar_owners)"},
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
    {"set_keeper", reinterpret_cast<PyCFunction>(Writer_set_keeper), METH_O,
     "set_keeper(keeper or None): keep each recorded op into an emulated graph's Keeper"},
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
  KeeperType.tp_getset = keeper_getset;
  if (!ready_type(KeeperType, "graphtrace.native.Keeper", sizeof(KeeperObject),
                  "An emulated graph's kept ops and aliases (Note [native keep]).", Keeper_new,
                  reinterpret_cast<destructor>(Keeper_dealloc), keeper_methods))
    return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&WriterType);
  Py_INCREF(&StoragesType);
  Py_INCREF(&KeeperType);
  if (PyModule_AddObject(m, "Writer", reinterpret_cast<PyObject*>(&WriterType)) < 0 ||
      PyModule_AddObject(m, "Storages", reinterpret_cast<PyObject*>(&StoragesType)) < 0 ||
      PyModule_AddObject(m, "Keeper", reinterpret_cast<PyObject*>(&KeeperType)) < 0 ||
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
