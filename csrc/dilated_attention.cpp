// The op's schema, written once, and the Python module stub that loads it.
//
// dilated_attention::fwd(q, k, v, ...) -> (out, lse)
//     q (B, N, Hq, D), k and v (B, N, Hkv, D); out (B, N, Hq, D); lse (B, Hq, N), float32
//     (float64 for float64 inputs). Computes LongNet dilated attention with all branches mixed
//     through one softmax (see dilated_attention.h and SPEC section 2-3).
// dilated_attention::bwd(dout, q, k, v, out, lse, dlse, ...) -> (dq, dk, dv)
//     Exact gradients of out (and of lse when dlse is given).
// dilated_attention::piece_fwd(q, k, v, is_causal, causal_offset, ...) -> (out, lse)
//     A piece of a segment that spans ranks: dense attention of q (B, nq, Hq, D) over k, v
//     (B, nk, Hkv, D); with is_causal, key j is visible to query i when j <= i + causal_offset.
// dilated_attention::piece_bwd(dout, q, k, v, out, lse, dlse, ...) -> (dq, dk, dv)
//     Its gradients for the given out and lse (the merged ones of the rows, in the ring).
// dilated_attention::varlen_fwd(q, k, v, cu_seqlens, max_seqlen, ...) -> (out, lse)
//     Packed sequences (FlashAttention's varlen convention, SPEC section 7): q (T, Hq, D), k and v
//     (T, Hkv, D), cu_seqlens int32 (S + 1,) on q's device; sequence i is the rows
//     [cu_seqlens[i], cu_seqlens[i + 1]) and attends as a sequence of its own. out (T, Hq, D),
//     lse (Hq, T). max_seqlen bounds the sequences' lengths (an error if one is longer).
// dilated_attention::varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, ...)
//     -> (dq, dk, dv)
//
// The forwards' float64_lse=True returns lse in float64 whatever the inputs' dtype (the backwards
// take lse in float32 or float64): a backward given that lse recomputes the probabilities without
// the rounding of lse to float32 (see checks.h lse_dtype). The Python layer asks for it and hands
// the caller lse in float32.
//
// Attention dropout (dropout_p > 0, dropout_seed, dropout_offset; SPEC section 3): the forwards
// drop weights with the counter-based generator of dropout.h, and the backwards given the same
// three arguments regenerate the same mask, the same on the CPU and on CUDA (the pieces take no
// dropout). dilated_attention::dropout_mask(B, H, Nq, Nk, ...) -> bool (B, H, Nq, Nk):
// the keep mask of query rows 0..Nq-1 and key rows 0..Nk-1, for tests and references (CPU). The
// seed and offset are SymInt in the ops' schemas, so that torch.compile can pass the values it
// draws in the graph (unbacked symbolic ints) without a graph break; the kernels read them as ints.
//
// dilated_attention::views_fwd(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale)
//     -> (out, lse) and views_bwd(dout, q, k, v, out, lse, dlse, ...) -> (dq, dk, dv): the sdpa
//     backend's driver (csrc/views/): PyTorch's fused attention operators on strided views of q,
//     k, v, merged by log-sum-exp; lse float32 (float64 for float64 inputs); no dropout.
//     views_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, ...) and views_varlen_bwd(...): the same on
//     packed sequences (shapes as varlen_fwd / varlen_bwd), each sequence a batch of its own.
//
// The fixed-length op is the packed one with S = B sequences of N rows: both run the same kernels.
//
// Each device registers its implementation with TORCH_LIBRARY_IMPL in cpu/ and cuda/.
#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include "views/merge_rule.h"
#include "views/plan.h"
#include "views/rows.h"

namespace dilated_attention {
const char* cpu_kernel_isa();  // cpu/isa.cpp
}

// _C.cpu_isa() -> str: the instruction set the CPU kernels run with in this process ("avx512",
// "avx2" or "baseline"); a bad DILATED_ATTENTION_CPU_ISA raises ValueError naming it.
static PyObject* cpu_isa(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(dilated_attention::cpu_kernel_isa());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return NULL;
  }
}

// The ints of a Python sequence of ints (what), or NULL with a Python error naming it.
static bool int_list(PyObject* seq, const char* what, std::vector<int64_t>* out) {
  PyObject* fast = PySequence_Fast(seq, "");
  if (fast == NULL) {
    PyErr_Format(PyExc_ValueError, "dilated_attention plan: %s must be a sequence of ints, got %R", what,
                 seq);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(fast, i);
    const long long v = PyLong_Check(item) ? PyLong_AsLongLong(item) : -1;
    if (!PyLong_Check(item) || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "dilated_attention plan: %s must be a sequence of ints, got %R", what,
                   seq);
      Py_DECREF(fast);
      return false;
    }
    out->push_back((int64_t)v);
  }
  Py_DECREF(fast);
  return true;
}

// A tuple of n Python ints from vals, or NULL (a Python error set).
static PyObject* int_tuple(const int64_t* vals, Py_ssize_t n) {
  PyObject* t = PyTuple_New(n);
  for (Py_ssize_t i = 0; t != NULL && i < n; ++i) {
    PyObject* v = PyLong_FromLongLong(vals[i]);
    if (v == NULL) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, i, v);
  }
  return t;
}

// The plan of the arguments (lengths, Hq, Hkv, segment_lengths, dilation_rates, native_gqa) at the
// start of args, or NULL with a Python error; *rest receives the int after them. With rest, an
// optional last argument repeat_kv (default 1: as the views driver plans, views/plan.h).
static std::shared_ptr<const dilated_attention::views::Plan> parse_plan(PyObject* args, const char* name,
                                                                        long long* rest) {
  PyObject *lengths_obj, *segs_obj, *rates_obj;
  long long Hq, Hkv;
  int native_gqa, repeat_kv = rest != nullptr;
  const std::string format = std::string(rest ? "OLLOOpL|p:" : "OLLOOp:") + name;
  if (rest ? !PyArg_ParseTuple(args, format.c_str(), &lengths_obj, &Hq, &Hkv, &segs_obj, &rates_obj,
                               &native_gqa, rest, &repeat_kv)
           : !PyArg_ParseTuple(args, format.c_str(), &lengths_obj, &Hq, &Hkv, &segs_obj, &rates_obj,
                               &native_gqa))
    return nullptr;
  std::vector<int64_t> lengths, segs, rates;
  if (!int_list(lengths_obj, "lengths", &lengths) || !int_list(segs_obj, "segment_lengths", &segs) ||
      !int_list(rates_obj, "dilation_rates", &rates))
    return nullptr;
  try {
    return dilated_attention::views::plan_branches(lengths, Hq, Hkv, segs, rates, native_gqa != 0,
                                                   repeat_kv != 0);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// A tuple of n tuples, the i-th of them row(i) (a new reference or NULL), or NULL.
template <typename Row>
static PyObject* tuple_of(size_t n, Row row) {
  PyObject* out = PyTuple_New((Py_ssize_t)n);
  for (size_t i = 0; out != NULL && i < n; ++i) {
    PyObject* item = row(i);
    if (item == NULL)
      Py_CLEAR(out);
    else
      PyTuple_SET_ITEM(out, (Py_ssize_t)i, item);
  }
  return out;
}

// _C.plan(lengths, Hq, Hkv, segment_lengths, dilation_rates, native_gqa): the kernel calls of every
// branch (views/plan.h), through the plan cache: a tuple per branch of one tuple of 16 ints per call,
// (start, rows, length, r, m, q.p0, q.dp, q.c0, q.dc, q.n, kv.p0, kv.dp, kv.c0, kv.dc, kv.n, g).
// lengths: the sequences of a packed batch (one for a fixed-length batch). Bad arguments raise
// ValueError naming them.
static PyObject* plan(PyObject*, PyObject* args) {
  const auto p = parse_plan(args, "plan", nullptr);
  if (!p) return NULL;
  return tuple_of(p->branches.size(), [&](size_t br) {
    const auto& calls = p->branches[br];
    return tuple_of(calls.size(), [&](size_t i) {
      const auto& c = calls[i];
      const int64_t vals[16] = {c.part.start, c.part.rows, c.part.length, c.r,   c.m,     c.q.p0,
                                c.q.dp,       c.q.c0,      c.q.dc,        c.q.n, c.kv.p0, c.kv.dp,
                                c.kv.c0,      c.kv.dc,     c.kv.n,        c.g};
      return int_tuple(vals, 16);
    });
  });
}

// _C.driver_calls(lengths, Hq, Hkv, segment_lengths, dilation_rates, native_gqa, B, repeat_kv=True):
// the kernel calls the C++ driver makes for a batch of B sequences of the plan (views/plan.h
// driver_calls; repeat_kv False: of the plan that never repeats k and v, which the driver does not run): a
// tuple per branch of (index of the first plan call, batch entry or -1 for all, count of plan calls,
// 1 where the driver gathers the run's rows into one batch, else 0, 1 where the branch reads k and v
// repeated to Hq heads, its calls those of the plan of Hkv = Hq, else 0, 1 where the gradient adds
// of earlier calls go before its own (plan.h DriverCall::adds_first), else 0).
static PyObject* driver_calls(PyObject*, PyObject* args) {
  long long B = 0;
  const auto p = parse_plan(args, "driver_calls", &B);
  if (!p) return NULL;
  if (B < 1) {
    PyErr_Format(PyExc_ValueError, "dilated_attention driver_calls: B must be >= 1, got %lld", B);
    return NULL;
  }
  int64_t N = 0;  // a fixed-length batch: one sequence
  for (const auto& calls : p->branches)
    for (const auto& c : calls) N = std::max(N, c.part.start + c.part.rows * c.part.length);
  return tuple_of(p->branches.size(), [&](size_t br) {
    const auto made = dilated_attention::views::driver_calls(p->branches[br], B, N);
    return tuple_of(made.size(), [&](size_t i) {
      const int64_t vals[6] = {made[i].index,      made[i].b,       made[i].count,
                               made[i].gathers(B), p->repeated[br], made[i].adds_first};
      return int_tuple(vals, 6);
    });
  });
}

// _C.plan_cache_info() -> (hits, misses, entries, max_entries) of the plan cache (views/plan.h),
// which every driver's plan goes through.
static PyObject* plan_cache_info(PyObject*, PyObject*) {
  const auto info = dilated_attention::views::plan_cache_info();
  const int64_t vals[4] = {info.hits, info.misses, info.entries, info.max_entries};
  return int_tuple(vals, 4);
}

// _C.plan_cache_clear(): empties the plan cache and zeroes its counts.
static PyObject* plan_cache_clear(PyObject*, PyObject*) {
  dilated_attention::views::plan_cache_clear();
  Py_RETURN_NONE;
}

extern "C" {
// Importing dilated_attention._C runs the static initialisers below, which register the op.
PyObject* PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"cpu_isa", cpu_isa, METH_NOARGS,
       "The instruction set the CPU kernels run with: avx512, avx2 or baseline."},
      {"plan", plan, METH_VARARGS,
       "plan(lengths, Hq, Hkv, segment_lengths, dilation_rates, native_gqa): the kernel calls of every "
       "branch, a tuple of 16 ints per call."},
      {"driver_calls", driver_calls, METH_VARARGS,
       "driver_calls(lengths, Hq, Hkv, segment_lengths, dilation_rates, native_gqa, B, repeat_kv=True): the "
       "C++ driver's "
       "kernel calls per branch, (first plan call, batch entry or -1, count of plan calls, gathered, "
       "k and v repeated, gradient adds before its own) each."},
      {"plan_cache_info", plan_cache_info, METH_NOARGS,
       "The plan cache's (hits, misses, entries, max_entries)."},
      {"plan_cache_clear", plan_cache_clear, METH_NOARGS, "Empties the plan cache and zeroes its counts."},
      {NULL, NULL, 0, NULL},
  };
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "Fused dilated attention kernels; the ops live in torch.ops.dilated_attention.",
      -1,  // size of per-interpreter state
      methods,
  };
  PyObject* module = PyModule_Create(&module_def);
  // what one launch of the CUDA driver's row moves (views/rows.h) and merges (merge_rule.h) takes
  if (module != NULL &&
      (PyModule_AddIntConstant(module, "row_pairs", dilated_attention::views::kRowPairs) < 0 ||
       PyModule_AddIntConstant(module, "merge_calls", dilated_attention::views::kMergeCalls) < 0)) {
    Py_DECREF(module);
    return NULL;
  }
  return module;
}
}

TORCH_LIBRARY(dilated_attention, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, int[] segment_lengths, int[] dilation_rates, "
      "bool is_causal, float softmax_scale, bool float64_lse=False, float dropout_p=0., "
      "SymInt dropout_seed=0, SymInt dropout_offset=0) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
      "int[] segment_lengths, int[] dilation_rates, bool is_causal, float softmax_scale, float dropout_p=0., "
      "SymInt dropout_seed=0, SymInt dropout_offset=0) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "piece_fwd(Tensor q, Tensor k, Tensor v, bool is_causal, int causal_offset, float softmax_scale, "
      "bool float64_lse=False) -> (Tensor out, Tensor lse)");
  m.def(
      "piece_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
      "bool is_causal, int causal_offset, float softmax_scale) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, int[] segment_lengths, "
      "int[] dilation_rates, bool is_causal, float softmax_scale, bool float64_lse=False, "
      "float dropout_p=0., SymInt dropout_seed=0, SymInt dropout_offset=0) -> (Tensor out, Tensor lse)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
      "Tensor cu_seqlens, int max_seqlen, int[] segment_lengths, int[] dilation_rates, bool is_causal, "
      "float softmax_scale, float dropout_p=0., SymInt dropout_seed=0, SymInt dropout_offset=0) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "views_fwd(Tensor q, Tensor k, Tensor v, int[] segment_lengths, int[] dilation_rates, bool is_causal, "
      "float softmax_scale) -> (Tensor out, Tensor lse)");
  m.def(
      "views_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
      "int[] segment_lengths, int[] dilation_rates, bool is_causal, float softmax_scale) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "views_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, int[] "
      "segment_lengths, "
      "int[] dilation_rates, bool is_causal, float softmax_scale) -> (Tensor out, Tensor lse)");
  m.def(
      "views_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
      "Tensor cu_seqlens, int max_seqlen, int[] segment_lengths, int[] dilation_rates, bool is_causal, "
      "float softmax_scale) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "dropout_mask(int B, int H, int Nq, int Nk, float dropout_p, int dropout_seed, int dropout_offset) -> "
      "Tensor");
}
