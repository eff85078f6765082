// Python bindings of pyalloc's out-of-memory observers (cuda/oom_observers.h):
// a Python callable as an observer, attached and detached by the callable.
// pyalloc/cuda.py's attach_oom_observer / detach_oom_observer are built on these.
//
// The observer runs on the allocating thread, which may not hold the GIL
// (PyTorch allocates from threads of its own; the bindings that allocate let
// go of it): the wrapper takes it for the call. It holds its callable's
// reference until it is detached, and drops it with the GIL too. Once the
// interpreter exits, nothing here calls into Python again: at exit every
// observer is detached, and a call already under way on another thread
// returns without calling, as does the dropping of its last reference.
#include <Python.h>

#include <atomic>
#include <string>

#include "cuda/oom_observers.h"
#include "py_bindings.h"

namespace py = pybind11;

namespace pyalloc {
namespace {

std::atomic<bool> exiting{false};  // set by the atexit handler bind_oom_observers registers

bool python_gone() {
#if PY_VERSION_HEX >= 0x030D0000
  return exiting.load() || !Py_IsInitialized() || Py_IsFinalizing();
#else
  return exiting.load() || !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// A Python callable as an OomObserver: std::function copies it, so the
// reference is shared, and released by whichever copy goes last.
class PyObserver {
 public:
  explicit PyObserver(py::handle fn) : ref_(std::make_shared<Ref>(fn)) {}

  void operator()(const OomReport& r) const {
    if (python_gone()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (!python_gone()) {
      try {
        py::handle(ref_->fn)(r.device, r.requested, r.device_total, r.device_free);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable(py::reinterpret_borrow<py::object>(ref_->fn));  // printed on stderr (sys.unraisablehook)
      }
    }
    PyGILState_Release(gil);
  }

  PyObject* callable() const { return ref_->fn; }

 private:
  struct Ref {
    explicit Ref(py::handle h) : fn(h.inc_ref().ptr()) {}
    ~Ref() {
      if (python_gone()) return;  // the interpreter is going: leave the reference to it
      PyGILState_STATE gil = PyGILState_Ensure();
      Py_DECREF(fn);
      PyGILState_Release(gil);
    }
    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    PyObject* fn;
  };
  std::shared_ptr<Ref> ref_;
};

void check_callable(py::handle fn) {
  if (!PyCallable_Check(fn.ptr()))
    throw py::type_error(std::string("an out-of-memory observer must be callable, not ") +
                         Py_TYPE(fn.ptr())->tp_name);
}

void attach(py::object fn) {
  check_callable(fn);
  attach_oom_observer(PyObserver(fn));
}

// Detaches the oldest observer whose callable equals fn (as list.remove
// finds it: a bound method is a new object at each access).
void detach(py::object fn) {
  check_callable(fn);
  for (;;) {
    bool found = false;
    for (const auto& [id, observer] : oom_observers()) {  // a copy: equality may run Python
      const PyObserver* mine = observer->target<PyObserver>();
      if (mine == nullptr) continue;
      int equal = PyObject_RichCompareBool(mine->callable(), fn.ptr(), Py_EQ);
      if (equal < 0) throw py::error_already_set();
      if (equal == 0) continue;
      if (detach_oom_observer(id)) return;
      found = true;  // another thread detached it meanwhile: look again
      break;
    }
    if (!found) break;
  }
  throw py::value_error("detach_oom_observer: " + py::repr(fn).cast<std::string>() +
                        " is not attached");
}

}  // namespace

void bind_oom_observers(py::module_& m) {
  m.def("cuda_attach_oom_observer", &attach, py::arg("fn"),
        "Calls fn(device, requested_bytes, device_total, device_free) at each out-of-memory error "
        "of pyalloc's CUDA pools, once no lock of theirs is held and before the error reaches the "
        "caller, with the GIL; what fn raises is printed and swallowed. TypeError if fn is not "
        "callable.");
  m.def("cuda_detach_oom_observer", &detach, py::arg("fn"),
        "Stops calling fn (the oldest attachment of a callable equal to it); ValueError if it is "
        "not attached, TypeError if it is not callable.");
  // At exit, with the GIL: no observer may call into a finalized interpreter,
  // and the callables are released while Python still can.
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    detach_all_oom_observers();
    exiting.store(true);
  }));
}

}  // namespace pyalloc
