// The trace's per-call record in C: dstest.trace.records.CallRecord's fields and the hooks every collective
// calls (construction, finished, waiting, waited), and the walk up the stack to a call's site.
//
// Only the CPython API: no torch header or library, so it compiles in about a second and loads without
// torch. Built on first use by dstest/trace/native/__init__.py, one call of the C++ compiler; the
// pure-Python record in records.py is used wherever this cannot be built (DSTEST_NATIVE=0 chooses it).
//
// Each function here does what its Python twin in dstest/trace/records.py does, field for field; the
// tests in tests/test_native_records.py hold the two to that, on random inputs.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <structmember.h>

#include <ctime>
#include <cstddef>

namespace {

// The Python side hands these over once (configure): the per-file-name skip table of the call-site walk,
// the function that classifies a file name it does not know yet (and stores the answer), and the function
// that turns an exception into the record's one-line error text.
PyObject* g_known = nullptr;     // dict: file name -> bool (skipped)
PyObject* g_classify = nullptr;  // callable(file name) -> bool
PyObject* g_error_text = nullptr;  // callable(exception) -> str
PyObject* g_str_send = nullptr;
PyObject* g_str_recv = nullptr;
PyObject* g_str_p2p = nullptr;
PyObject* g_str_collective = nullptr;
PyObject* g_str_last = nullptr;

struct Record {
  PyObject_HEAD
  PyObject* callers;
  PyObject* dtype;
  PyObject* error;
  PyObject* group;
  PyObject* kind;
  PyObject* nbytes;
  PyObject* numel;
  PyObject* op;
  PyObject* peer;
  PyObject* rank;
  PyObject* reduce_op;
  PyObject* root;
  PyObject* seq;
  PyObject* shapes;
  PyObject* site;
  PyObject* sync;
  PyObject* t_done;
  PyObject* t_post;
  PyObject* t_wait;
  PyObject* t_waited;
  PyObject* tag;
  PyObject* wait_site;
};

constexpr Py_ssize_t kFields = 22;

PyObject** fields(Record* r) { return &r->callers; }

// time.perf_counter_ns on Linux: CLOCK_MONOTONIC, the system-wide clock every record of every process of
// a run is read on (the process world merges records across processes). Elsewhere, Python's own.
PyObject* g_perf_counter_ns = nullptr;

PyObject* now_ns() {
#if defined(__linux__)
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) {
    return PyLong_FromLongLong(static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec);
  }
#endif
  return PyObject_CallNoArgs(g_perf_counter_ns);
}

bool is_none(PyObject* o) { return o == nullptr || o == Py_None; }

void set_field(PyObject** slot, PyObject* value) {  // steals value
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
}

// The first frame, from `frame` (borrowed) and `backs` frames up, whose file is not skipped:
// (file, line, function), or None.
PyObject* site_from(PyFrameObject* frame, int backs) {
  Py_XINCREF(frame);
  for (int i = 0; i < backs && frame != nullptr; ++i) {
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    PyObject* filename = code->co_filename;
    PyObject* known = PyDict_GetItemWithError(g_known, filename);  // borrowed
    int skipped;
    if (known != nullptr) {
      skipped = PyObject_IsTrue(known);
    } else if (PyErr_Occurred()) {
      skipped = -1;
    } else {
      PyObject* answer = PyObject_CallOneArg(g_classify, filename);
      skipped = answer == nullptr ? -1 : PyObject_IsTrue(answer);
      Py_XDECREF(answer);
    }
    if (skipped < 0) {
      Py_DECREF(code);
      Py_DECREF(frame);
      return nullptr;
    }
    if (!skipped) {
      PyObject* site = Py_BuildValue("(OiO)", filename, PyFrame_GetLineNumber(frame), code->co_name);
      Py_DECREF(code);
      Py_DECREF(frame);
      return site;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  Py_RETURN_NONE;
}

bool configured() {
  if (g_known == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "dstest's native records are not configured (configure() was not called)");
    return false;
  }
  return true;
}

// -- CallRecord ---------------------------------------------------------------------------------------
PyObject* record_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  if ((kwds != nullptr && PyDict_GET_SIZE(kwds) != 0) || (n != 0 && n != 8)) {
    PyErr_SetString(PyExc_TypeError,
                    "CallRecord(rank, op, group, seq, dtype, shapes, numel, nbytes) takes 8 positional "
                    "arguments (or none, for from_dict)");
    return nullptr;
  }
  auto* self = reinterpret_cast<Record*>(type->tp_alloc(type, 0));
  if (self == nullptr) {
    return nullptr;
  }
  PyObject** f = fields(self);
  for (Py_ssize_t i = 0; i < kFields; ++i) {
    f[i] = Py_NewRef(Py_None);
  }
  if (n == 0) {
    return reinterpret_cast<PyObject*>(self);
  }
  PyObject* op = PyTuple_GET_ITEM(args, 1);
  set_field(&self->rank, Py_NewRef(PyTuple_GET_ITEM(args, 0)));
  set_field(&self->op, Py_NewRef(op));
  bool p2p = false;
  if (PyUnicode_Check(op)) {
    p2p = PyUnicode_Compare(op, g_str_send) == 0 || PyUnicode_Compare(op, g_str_recv) == 0;
  }
  set_field(&self->kind, Py_NewRef(p2p ? g_str_p2p : g_str_collective));
  set_field(&self->group, Py_NewRef(PyTuple_GET_ITEM(args, 2)));
  set_field(&self->seq, Py_NewRef(PyTuple_GET_ITEM(args, 3)));
  set_field(&self->dtype, Py_NewRef(PyTuple_GET_ITEM(args, 4)));
  set_field(&self->shapes, Py_NewRef(PyTuple_GET_ITEM(args, 5)));
  set_field(&self->numel, Py_NewRef(PyTuple_GET_ITEM(args, 6)));
  set_field(&self->nbytes, Py_NewRef(PyTuple_GET_ITEM(args, 7)));
  PyObject* t = now_ns();
  if (t == nullptr) {
    Py_DECREF(self);
    return nullptr;
  }
  set_field(&self->t_post, t);
  set_field(&self->callers, PyTuple_New(0));
  set_field(&self->sync, Py_NewRef(Py_False));
  return reinterpret_cast<PyObject*>(self);
}

void record_dealloc(Record* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject** f = fields(self);
  for (Py_ssize_t i = 0; i < kFields; ++i) {
    Py_CLEAR(f[i]);
  }
  type->tp_free(reinterpret_cast<PyObject*>(self));
  Py_DECREF(type);  // a heap type: each instance holds a reference to it (taken by tp_alloc)
}

// finished(error): the call completed (any thread); error: it failed.
PyObject* record_finished(Record* self, PyObject* error) {
  if (is_none(self->t_done)) {
    PyObject* t = now_ns();
    if (t == nullptr) {
      return nullptr;
    }
    set_field(&self->t_done, t);
  }
  if (!is_none(error) && is_none(self->error)) {
    if (!configured()) {
      return nullptr;
    }
    PyObject* text = PyObject_CallOneArg(g_error_text, error);
    if (text == nullptr) {
      return nullptr;
    }
    set_field(&self->error, text);
  }
  Py_RETURN_NONE;
}

// waiting(log=None): the rank starts waiting for this call, on its own thread.
PyObject* record_waiting(Record* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "waiting() takes at most 1 argument (log)");
    return nullptr;
  }
  if (!is_none(self->t_wait)) {
    Py_RETURN_NONE;
  }
  PyObject* t = now_ns();
  if (t == nullptr) {
    return nullptr;
  }
  set_field(&self->t_wait, t);
  bool sync = false;
  PyObject* log = nargs == 1 ? args[0] : Py_None;
  if (log != Py_None) {
    PyObject* last = PyObject_GetAttr(log, g_str_last);
    if (last == nullptr) {
      return nullptr;
    }
    sync = last == reinterpret_cast<PyObject*>(self);
    Py_DECREF(last);
  }
  set_field(&self->sync, Py_NewRef(sync ? Py_True : Py_False));
  PyObject* site;
  if (sync) {  // a blocking call waits where it was called; only a later wait needs its own site
    site = Py_NewRef(self->site == nullptr ? Py_None : self->site);
  } else {
    if (!configured()) {
      return nullptr;
    }
    // The Python twin calls call_site(3) from inside waiting(): the frame of the one who called wait().
    // Here the running frame is the caller of waiting(), one below that.
    site = site_from(PyEval_GetFrame(), 1);
    if (site == nullptr) {
      return nullptr;
    }
  }
  set_field(&self->wait_site, site);
  Py_RETURN_NONE;
}

PyObject* record_waited(Record* self, PyObject* /*unused*/) {
  if (is_none(self->t_waited)) {
    PyObject* t = now_ns();
    if (t == nullptr) {
      return nullptr;
    }
    set_field(&self->t_waited, t);
  }
  Py_RETURN_NONE;
}

PyMethodDef record_methods[] = {
    {"finished", reinterpret_cast<PyCFunction>(record_finished), METH_O,
     "The call completed (any thread); error: it failed."},
    {"waiting", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record_waiting)), METH_FASTCALL,
     "The rank starts waiting for this call (on its own thread)."},
    {"waited", reinterpret_cast<PyCFunction>(record_waited), METH_NOARGS, "The rank's wait returned."},
    {nullptr, nullptr, 0, nullptr},
};

#define FIELD(name) {#name, T_OBJECT, offsetof(Record, name), 0, nullptr}
PyMemberDef record_members[] = {
    FIELD(callers), FIELD(dtype),  FIELD(error),  FIELD(group),    FIELD(kind),      FIELD(nbytes),
    FIELD(numel),   FIELD(op),     FIELD(peer),   FIELD(rank),     FIELD(reduce_op), FIELD(root),
    FIELD(seq),     FIELD(shapes), FIELD(site),   FIELD(sync),     FIELD(t_done),    FIELD(t_post),
    FIELD(t_wait),  FIELD(t_waited), FIELD(tag),  FIELD(wait_site), {nullptr, 0, 0, 0, nullptr},
};
#undef FIELD

// A heap type without garbage-collector support: a record holds strings, ints and tuples of them, never a
// cycle, so the collector need not track the hundreds of records a run keeps per rank. Not immutable: the
// Python side adds the reading methods (describe, status, ...) to it, which both implementations share.
PyType_Slot record_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(record_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(record_dealloc)},
    {Py_tp_methods, record_methods},
    {Py_tp_members, record_members},
    {Py_tp_doc, const_cast<char*>("One rank's side of one collective or transfer (records.CallRecord's fields).")},
    {0, nullptr},
};

PyType_Spec record_spec = {"dstest_native_records.CallRecord", sizeof(Record), 0, Py_TPFLAGS_DEFAULT,
                           record_slots};

// -- module functions ----------------------------------------------------------------------------------
// call_site(depth=2): as records.call_site, whose frame is depth 0: here the caller's frame is depth 1.
PyObject* call_site(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "call_site() takes at most 1 argument (depth)");
    return nullptr;
  }
  int depth = 2;
  if (nargs == 1) {
    depth = PyLong_AsLong(args[0]);
    if (depth == -1 && PyErr_Occurred()) {
      return nullptr;
    }
  }
  if (depth < 1) {
    PyErr_Format(PyExc_ValueError, "call_site(depth=%d): depth must be at least 1 (1 is the caller)", depth);
    return nullptr;
  }
  if (!configured()) {
    return nullptr;
  }
  return site_from(PyEval_GetFrame(), depth - 1);
}

PyObject* configure(PyObject* /*module*/, PyObject* args) {
  PyObject *known, *classify, *error_text, *perf_counter_ns;
  if (!PyArg_ParseTuple(args, "O!OOO", &PyDict_Type, &known, &classify, &error_text, &perf_counter_ns)) {
    return nullptr;
  }
  Py_XSETREF(g_known, Py_NewRef(known));
  Py_XSETREF(g_classify, Py_NewRef(classify));
  Py_XSETREF(g_error_text, Py_NewRef(error_text));
  Py_XSETREF(g_perf_counter_ns, Py_NewRef(perf_counter_ns));
  Py_RETURN_NONE;
}

PyObject* now(PyObject* /*module*/, PyObject* /*unused*/) {
  if (g_perf_counter_ns == nullptr && !configured()) {
    return nullptr;
  }
  return now_ns();
}

PyMethodDef module_methods[] = {
    {"call_site", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_site)), METH_FASTCALL,
     "(file, line, function) of the innermost frame outside the skipped files, from depth (1: the caller)."},
    {"configure", configure, METH_VARARGS,
     "configure(known, classify, error_text, perf_counter_ns): the Python side's tables and helpers."},
    {"now_ns", now, METH_NOARGS, "The records' clock (ns), as the records read it."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dstest_native_records", "dstest's per-call trace record, in C", -1,
                          module_methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

#ifndef DSTEST_MODULE_NAME
#define DSTEST_MODULE_NAME dstest_native_records
#endif
#define DSTEST_CAT(a, b) a##b
#define DSTEST_INIT(name) DSTEST_CAT(PyInit_, name)

PyMODINIT_FUNC DSTEST_INIT(DSTEST_MODULE_NAME)(void) {
  PyObject* record_type = PyType_FromSpec(&record_spec);
  if (record_type == nullptr) {
    return nullptr;
  }
  g_str_send = PyUnicode_InternFromString("send");
  g_str_recv = PyUnicode_InternFromString("recv");
  g_str_p2p = PyUnicode_InternFromString("p2p");
  g_str_collective = PyUnicode_InternFromString("collective");
  g_str_last = PyUnicode_InternFromString("last");
  if (g_str_send == nullptr || g_str_recv == nullptr || g_str_p2p == nullptr || g_str_collective == nullptr ||
      g_str_last == nullptr) {
    return nullptr;
  }
  module_def.m_name = Py_STRINGIFY(DSTEST_MODULE_NAME);
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) {
    return nullptr;
  }
  if (PyModule_AddObject(m, "CallRecord", record_type) < 0) {  // steals record_type on success
    Py_DECREF(record_type);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
