"""Scenarios of PyTorch's own RPC test suite (``torch/testing/_internal/distributed/rpc/
rpc_test.py``, class ``RpcTest``), run on ``rdzv.rpc``: the ones that need neither
TorchScript, distributed autograd, the profiler nor CUDA. Each worker runs every scenario
against the next rank, as torch's tests do, with torch tensors as the payloads.

Ported (torch's test names): test_worker_id, test_get_worker_infos, test_self_add,
test_send_to_rank, test_invalid_names, test_worker_info_pickle, test_add,
test_int_callee, test_add_with_id, test_scalar_add, test_async_add, test_nonzero,
test_multi_rpc, test_future_wait_twice, test_py_built_in, test_py_user_defined,
test_py_class_constructor, test_py_class_instance_method, test_py_class_method,
test_py_class_static_method, test_py_multi_async_call, test_py_no_return_result,
test_py_tensors, test_py_tensors_multi_async_call, test_py_tensors_in_container,
test_py_function_exception, test_py_raise_in_user_func (the raise, not the stderr log),
test_py_raise_in_user_func_escaped_str, test_nested_rpc, test_stress_light_rpc,
test_stress_heavy_rpc, test_builtin_remote_ret, test_builtin_remote_self,
test_multi_builtin_remote_ret, test_py_udf_remote, test_multi_py_udf_remote,
test_py_rref_args, test_py_rref_args_user_share, test_py_rpc_rref_args,
test_nested_remote, test_nested_rref, test_nested_rref_stress,
test_multi_layer_nested_async_rpc, test_remote_with_exception, test_rpc_return_rref,
test_rref_forward_chain, test_local_rref_no_fork, test_return_local_rrefs,
test_owner_equality, test_pass_local_rrefs, test_remote_same_worker,
test_call_method_on_rref, test_self_py_udf_remote, test_self_remote_rref_as_rpc_arg,
test_self_remote_rref_as_remote_arg, test_graceful_shutdown_with_uneven_workload,
test_shutdown_followed_by_rpc, test_local_shutdown, test_set_and_get_default_rpc_timeout,
test_world_size_one.

Not ported: TorchScript (``*_script_*``, ``*_torchscript``), the profiler, distributed
autograd and optimizers, CUDA and device maps (the GPU issue), sparse tensors, torch's
internal agent hooks (``_get_current_rpc_agent``, fault injection), and the RRef id texts
(``test_rref_str``, ``test_local_value_not_on_owner``: rdzv's RRef ids differ).

torch is needed for the tensors; without it the module is skipped, saying so.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable, Dict, List

import pytest

torch = pytest.importorskip(
    "torch", reason="the port of torch's rpc_test.py sends torch tensors (pip install torch)"
)

import test_rpc  # noqa: E402
from test_rpc import assert_all_true  # noqa: E402

WORLD = 3

# --- What the workers call (the functions of torch's rpc_test.py, rewritten). ----------


def worker_name(rank: int) -> str:
    return f"worker{rank}"


class MyClass:
    def __init__(self, a: Any) -> None:
        self.a = a

    def my_instance_method(self, b: Any) -> Any:
        return self.a + b

    @classmethod
    def my_class_method(cls, d: Any, e: Any) -> Any:
        return d + e

    @staticmethod
    def my_static_method(f: Any) -> bool:
        return f > 10

    def increment_value(self, increment: int) -> None:
        self.a += increment

    def get_value(self) -> Any:
        return self.a


class TensorClass:
    def __init__(self, tensors: Any) -> None:
        self.tensors = tensors


def my_function(a: Any, b: Any, c: Any) -> Any:
    return a + b + c


def my_tensor_function(a: Any, b: Any) -> Any:
    return a + b


def my_complex_tensor_function(list_input: Any, tensor_class_input: Any, dict_input: Any) -> Any:
    total = list_input[0]
    for t in list_input:
        total = total + t
    for v in dict_input.values():
        total = total + v
    inner = tensor_class_input.tensors
    return (total, inner[0], inner[1], inner[2])


def build_complex_tensors() -> List[Any]:
    a = torch.ones(3, 3)
    b = [a, a]
    c = [b, b]
    d = [a, b]
    e = {"a": d}
    return [a, b, c, d, e]


def my_rref_function(rref_a: Any, rref_b: Any) -> Any:
    return rref_a.to_here() + rref_b.to_here()


def add_rref_to_value(rref: Any, value: Any) -> Any:
    return rref.to_here() + value


def call_method_on_rref(method: Callable[..., Any], rref: Any, *args: Any) -> Any:
    return method(rref.local_value(), *args)


def get_rref_list(values: List[int]) -> List[Any]:
    import rdzv.rpc as rpc

    return [rpc.RRef(MyClass(a)) for a in values]


def identity(a: Any) -> Any:
    return a


def no_result() -> None:
    return None


def raise_func() -> None:
    raise ValueError("Expected error")


def raise_func_escape() -> None:
    raise ValueError("Expected error\nwith a second line")


def return_callee_id() -> int:
    import rdzv.rpc as rpc

    return rpc.get_worker_info().id


def nested_rpc(dst: str) -> Any:
    import rdzv.rpc as rpc

    return rpc.rpc_sync(dst, torch.add, args=(torch.ones(2, 2), 1))


def nested_remote(dst: str) -> Any:
    import rdzv.rpc as rpc

    return rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 3)).to_here()


def nested_rref(dst: str) -> Any:
    import rdzv.rpc as rpc

    return (
        rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 1)),
        rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 2)),
    )


def rpc_return_rref(dst: str) -> Any:
    import rdzv.rpc as rpc

    return rpc.remote(dst, torch.add, args=(torch.ones(2, 2), 1))


def rref_forward_chain(dst: int, world_size: int, rref: Any, ttl: int) -> Any:
    import rdzv.rpc as rpc

    if ttl > 0:
        ret_rref = rpc.remote(
            worker_name(dst), rref_forward_chain, args=((dst + 1) % world_size, world_size, rref, ttl - 1)
        )
        return [ret_rref]
    return rref.to_here()


def multi_layer_nested_async_rpc(dst: int, world_size: int, ttl: int) -> int:
    import rdzv.rpc as rpc

    if ttl > 0:
        rpc.rpc_async(
            worker_name(dst), multi_layer_nested_async_rpc, args=((dst + 1) % world_size, world_size, ttl - 1)
        )
    return 0


def light_rpc() -> int:
    return 0


def heavy_rpc(tensor: Any) -> int:
    for i in range(1, 100):
        tensor *= i
        tensor /= i + 1
    return 0


# --- The scenarios: each a list of torch's tests, run by every rank. ---------------------


def run_checks(checks: Dict[str, Callable[[], Any]]) -> Dict[str, Any]:
    """Runs each check; a check passes by returning without raising (``assert`` inside)."""
    seen: Dict[str, Any] = {}
    for name, check in checks.items():
        try:
            check()
            seen[name] = True
        except BaseException:  # noqa: BLE001 - reported by name
            seen[name] = traceback.format_exc(limit=4)
    return seen


def equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    else:
        assert a == b, (a, b)


def raises(kind: type, call: Callable[[], Any], text: str = "") -> None:
    try:
        call()
    except kind as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"{call} did not raise {kind.__name__}")


def scenario_calls(rpc: Any, rank: int, world: int) -> Dict[str, Any]:
    n = rank + 1
    dst_rank = n % world
    dst = worker_name(dst_rank)
    me = rpc.get_worker_info()

    def run_in_mode(to: Any, fn: Any, mode: str, args: Any) -> Any:
        if mode == "sync":
            return rpc.rpc_sync(to, fn, args=args)
        if mode == "async":
            return rpc.rpc_async(to, fn, args=args).wait()
        return rpc.remote(to, fn, args=args).to_here()

    def worker_id() -> None:
        equal(me.name, worker_name(rank))
        equal(rpc.get_worker_info(dst).name, dst)
        raises(RuntimeError, lambda: rpc.get_worker_info("WorkerUnknown"), "could not find destination")

    def get_worker_infos() -> None:
        infos = rpc._get_worker_infos()
        equal({i.name for i in infos}, {worker_name(r) for r in range(world)})
        equal({i.id for i in infos}, set(range(world)))

    def self_add() -> None:
        fut = rpc.rpc_async(me, torch.add, args=(torch.ones(2, 2), 1))
        ret = rpc.rpc_sync(me, torch.add, args=(torch.ones(2, 2), 1))
        equal(fut.wait(), torch.ones(2, 2) + 1)
        equal(ret, torch.ones(2, 2) + 1)

    def send_to_rank() -> None:
        for mode in ("sync", "async", "remote"):
            equal(run_in_mode(dst_rank, torch.add, mode, (torch.ones(2, 2), 1)), torch.ones(2, 2) + 1)
        for mode in ("sync", "async", "remote"):
            for bad in (world + 1, -1):
                raises(RuntimeError, lambda: run_in_mode(bad, torch.add, mode, (torch.ones(2, 2), 1)))
            for bad_f in (dst_rank + 0.5, dst_rank - 0.5):
                raises(ValueError, lambda: run_in_mode(bad_f, torch.add, mode, (torch.ones(2, 2), 1)))

    def invalid_names() -> None:
        raises(RuntimeError, lambda: rpc.WorkerInfo("abc*", 0), "Worker name must match")
        raises(RuntimeError, lambda: rpc.WorkerInfo(" ", 0), "Worker name must match")
        raises(RuntimeError, lambda: rpc.WorkerInfo("", 0), "must be non-empty")
        raises(RuntimeError, lambda: rpc.WorkerInfo("a" * 500, 0), "shorter than 128")

    def worker_info_pickle() -> None:
        equal(rpc.rpc_sync(dst, identity, args=(me,)), me)

    def add() -> None:
        ret = rpc.rpc_sync(dst, torch.add, args=(torch.ones(n, n), torch.ones(n, n)))
        equal(ret, torch.ones(n, n) * 2)

    def int_callee() -> None:
        equal(rpc.rpc_sync(dst_rank, return_callee_id), dst_rank)

    def add_with_id() -> None:
        info = rpc.get_worker_info(dst)
        equal(rpc.rpc_sync(info, torch.add, args=(torch.ones(n, n), torch.ones(n, n))), torch.ones(n, n) * 2)

    def scalar_add() -> None:
        equal(rpc.rpc_sync(dst, torch.add, args=(torch.ones(n, n), n)), torch.ones(n, n) + n)

    def async_add() -> None:
        fut = rpc.rpc_async(dst, torch.add, args=(torch.ones(n, n), torch.ones(n, n)))
        equal(fut.wait(), torch.ones(n, n) * 2)

    def nonzero() -> None:
        x = torch.ones(world, world)
        x[rank][rank] = 0
        equal(rpc.rpc_sync(dst, torch.nonzero, args=(x,)), x.nonzero())

    def multi_rpc() -> None:
        for _ in range(20):
            x, y = torch.ones(2, 2), torch.ones(2, 2)
            equal(rpc.rpc_sync(dst, torch.add, args=(x, y)), x * 2)

    def future_wait_twice() -> None:
        futs = [rpc.rpc_async(dst, raise_func) for _ in range(20)]
        raises(ValueError, lambda: torch.futures.wait_all(futs), "Expected error")
        for fut in futs:
            raises(ValueError, fut.wait, "Expected error")

    def py_built_in() -> None:
        equal(rpc.rpc_sync(dst, min, args=(n, n + 1, n + 2)), min(n, n + 1, n + 2))

    def py_user_defined() -> None:
        ret = rpc.rpc_sync(dst, my_function, kwargs={"a": n, "b": n + 1, "c": n + 2})
        equal(ret, my_function(n, n + 1, n + 2))

    def py_class_constructor() -> None:
        equal(rpc.rpc_sync(dst, MyClass, args=(n,)).a, n)

    def py_class_instance_method() -> None:
        equal(rpc.rpc_sync(dst, MyClass(2).my_instance_method, args=(n,)), MyClass(2).my_instance_method(n))

    def py_class_method() -> None:
        equal(rpc.rpc_sync(dst, MyClass.my_class_method, args=(n, n + 1)), MyClass.my_class_method(n, n + 1))

    def py_class_static_method() -> None:
        equal(rpc.rpc_sync(dst, MyClass.my_static_method, args=(n + 10,)), MyClass.my_static_method(n + 10))

    def py_multi_async_call() -> None:
        info = rpc.get_worker_info(dst)
        fut1 = rpc.rpc_async(info, MyClass.my_static_method, args=(n + 10,))
        fut2 = rpc.rpc_async(info, min, args=(n, n + 1, n + 2))
        equal(fut1.wait(), MyClass.my_static_method(n + 10))
        equal(fut2.wait(), min(n, n + 1, n + 2))

    def py_no_return_result() -> None:
        equal(rpc.rpc_sync(dst, no_result), no_result())

    def py_tensors() -> None:
        ret = rpc.rpc_sync(dst, my_tensor_function, args=(torch.ones(n, n), torch.ones(n, n)))
        equal(ret, my_tensor_function(torch.ones(n, n), torch.ones(n, n)))

    def py_tensors_multi_async_call() -> None:
        futs = [
            rpc.rpc_async(dst, my_tensor_function, args=(torch.ones(i, i), torch.ones(i, i)))
            for i in range(100)
        ]
        for j, val in enumerate(torch.futures.wait_all(futs)):
            equal(val, my_tensor_function(torch.ones(j, j), torch.ones(j, j)))

    def py_tensors_in_container() -> None:
        a = [torch.ones(n, n), torch.ones(n, n)]
        b = TensorClass(build_complex_tensors())
        c = {"foo": torch.ones(n, n), "bar": torch.ones(n, n)}
        ret = rpc.rpc_sync(dst, my_complex_tensor_function, args=(a, b, c))
        expected = my_complex_tensor_function(a, b, c)
        equal(ret[0], expected[0])
        equal(ret[1], expected[1])
        equal(len(ret[2]), len(expected[2]))
        equal(ret[3][0][0], expected[3][0][0])

    def py_function_exception() -> None:
        raises(TypeError, lambda: rpc.rpc_sync(dst, no_result, args=(10,)))

    def py_raise_in_user_func() -> None:
        raises(ValueError, rpc.rpc_async(dst, raise_func).wait, "Expected error")

    def py_raise_in_user_func_escaped_str() -> None:
        try:
            rpc.rpc_async(dst, raise_func_escape).wait()
        except ValueError as e:
            msg = str(e)
            assert msg == msg.encode("utf-8").decode("unicode_escape"), msg
        else:
            raise AssertionError("expected raise_func_escape to raise ValueError")

    def nested() -> None:
        equal(rpc.rpc_sync(dst, nested_rpc, args=(worker_name(rank),)), torch.ones(2, 2) + 1)

    def stress_light_rpc() -> None:
        futs = [rpc.rpc_async(dst, light_rpc) for _ in range(1000)]
        assert all(v == 0 for v in torch.futures.wait_all(futs))

    def stress_heavy_rpc() -> None:
        futs = [rpc.rpc_async(dst, heavy_rpc, args=(torch.ones(100, 100),)) for _ in range(20)]
        assert all(v == 0 for v in torch.futures.wait_all(futs))

    return run_checks(
        {
            "test_worker_id": worker_id,
            "test_get_worker_infos": get_worker_infos,
            "test_self_add": self_add,
            "test_send_to_rank": send_to_rank,
            "test_invalid_names": invalid_names,
            "test_worker_info_pickle": worker_info_pickle,
            "test_add": add,
            "test_int_callee": int_callee,
            "test_add_with_id": add_with_id,
            "test_scalar_add": scalar_add,
            "test_async_add": async_add,
            "test_nonzero": nonzero,
            "test_multi_rpc": multi_rpc,
            "test_future_wait_twice": future_wait_twice,
            "test_py_built_in": py_built_in,
            "test_py_user_defined": py_user_defined,
            "test_py_class_constructor": py_class_constructor,
            "test_py_class_instance_method": py_class_instance_method,
            "test_py_class_method": py_class_method,
            "test_py_class_static_method": py_class_static_method,
            "test_py_multi_async_call": py_multi_async_call,
            "test_py_no_return_result": py_no_return_result,
            "test_py_tensors": py_tensors,
            "test_py_tensors_multi_async_call": py_tensors_multi_async_call,
            "test_py_tensors_in_container": py_tensors_in_container,
            "test_py_function_exception": py_function_exception,
            "test_py_raise_in_user_func": py_raise_in_user_func,
            "test_py_raise_in_user_func_escaped_str": py_raise_in_user_func_escaped_str,
            "test_nested_rpc": nested,
            "test_stress_light_rpc": stress_light_rpc,
            "test_stress_heavy_rpc": stress_heavy_rpc,
        }
    )


def scenario_rrefs(rpc: Any, rank: int, world: int) -> Dict[str, Any]:
    n = rank + 1
    dst_rank = n % world
    dst = worker_name(dst_rank)
    third = worker_name((n + 1) % world)
    me = rpc.get_worker_info()
    ones = torch.ones(2, 2)

    def builtin_remote_ret() -> None:
        equal(rpc.remote(dst, torch.add, args=(ones, ones)).to_here(), ones * 2)

    def builtin_remote_self() -> None:
        equal(rpc.remote(worker_name(rank), torch.add, args=(ones, ones)).local_value(), ones * 2)

    def multi_builtin_remote_ret() -> None:
        rrefs, expected = [], []
        m = n
        for i in range(10):
            m = m + i
            args = (torch.ones(m, m), torch.ones(m, m))
            rrefs.append(rpc.remote(dst, torch.add, args=args))
            expected.append(torch.add(*args))
        for rref, want in zip(rrefs, expected):
            equal(rref.to_here(), want)

    def py_udf_remote() -> None:
        rref = rpc.remote(dst, my_function, kwargs={"a": n, "b": n + 1, "c": n + 2})
        equal(rref.to_here(), my_function(n, n + 1, n + 2))

    def multi_py_udf_remote() -> None:
        rrefs, expected = [], []
        m = n
        for i in range(10):
            m = m + i
            kwargs = {k: torch.ones(m, m) for k in "abc"}
            rrefs.append(rpc.remote(dst, my_function, kwargs=kwargs))
            expected.append(my_function(**kwargs))
        for rref, want in zip(rrefs, expected):
            equal(rref.to_here(), want)

    def py_rref_args() -> None:
        a = rpc.remote(dst, torch.add, args=(ones, 1))
        b = rpc.remote(dst, torch.add, args=(ones, 2))
        c = rpc.remote(dst, my_rref_function, args=(a, b))
        equal(c.to_here(), ones * 2 + 3)

    def py_rref_args_user_share() -> None:
        a = rpc.remote(dst, my_function, args=(ones, 1, 2))
        b = rpc.remote(dst, my_function, args=(ones, 3, 4))
        c = rpc.remote(third, my_rref_function, args=(a, b))
        equal(c.to_here(), ones * 2 + 10)

    def py_rpc_rref_args() -> None:
        a = rpc.remote(dst, my_function, args=(ones, 1, 2))
        b = rpc.remote(dst, my_function, args=(ones, 3, 4))
        equal(rpc.rpc_sync(dst, my_rref_function, args=(a, b)), ones * 2 + 10)

    def nested_remote_() -> None:
        equal(rpc.remote(dst, nested_remote, args=(third,)).to_here(), ones + 3)

    def nested_rref_() -> None:
        rrefs = rpc.remote(dst, nested_rref, args=(third,)).to_here()
        equal(len(rrefs), 2)
        equal(rrefs[0].to_here(), ones + 1)
        equal(rrefs[1].to_here(), ones + 2)

    def nested_rref_stress() -> None:
        all_rrefs = [rpc.remote(dst, nested_rref, args=(third,)) for _ in range(20)]
        for rref_of_rrefs in all_rrefs:
            rrefs = rref_of_rrefs.to_here()
            equal(len(rrefs), 2)
            equal(rrefs[0].to_here(), ones + 1)
            equal(rrefs[1].to_here(), ones + 2)

    def multi_layer_nested_async() -> None:
        multi_layer_nested_async_rpc(dst_rank, world, 20)

    def remote_with_exception() -> None:
        raises(ValueError, rpc.remote(dst, raise_func).to_here)
        raises(TypeError, rpc.remote(worker_name(rank), no_result, args=(10,)).to_here)

    def rpc_return_rref_() -> None:
        rref = rpc.rpc_sync(dst, rpc_return_rref, args=(third,))
        equal(rref.to_here(), ones + 1)

    def forward_chain() -> None:
        ttl = 8
        rref = rpc.remote(dst, torch.add, args=(torch.ones(n, n), 1))
        ret = rref_forward_chain(dst_rank, world, rref, ttl)
        for _ in range(ttl):
            equal(len(ret), 1)
            ret = ret[0].to_here()
        equal(ret, torch.add(torch.ones(n, n), 1))

    def local_rref_no_fork() -> None:
        equal(rpc.RRef(35).local_value(), 35)
        # The owner holds the object itself, as torch's RRef(value) does.
        held = MyClass(1)
        assert rpc.RRef(held).local_value() is held

    def return_local_rrefs() -> None:
        rref_list = rpc.rpc_sync(dst, get_rref_list, args=([1, 2, 3],))
        for rref in rref_list:
            rpc.rpc_sync(rref.owner(), call_method_on_rref, args=(MyClass.increment_value, rref, 10))
        rets = [rpc.rpc_sync(r.owner(), call_method_on_rref, args=(MyClass.get_value, r)) for r in rref_list]
        equal(rets, [11, 12, 13])

    def owner_equality() -> None:
        a, b = rpc.RRef(40), rpc.RRef(50)
        other_a = rpc.remote(dst, torch.add, args=(torch.ones(1), 1))
        other_b = rpc.remote(dst, torch.add, args=(torch.ones(1), 1))
        other_a.to_here()
        other_b.to_here()
        assert a.owner() != 23
        equal(other_a.owner(), other_b.owner())
        assert a.owner() != other_a.owner()
        equal(a.owner(), b.owner())
        equal(a.owner(), me)
        x = {a.owner(): a, other_a.owner(): other_a}
        assert x[b.owner()] is a and x[other_b.owner()] is other_a and len(x) == 2

    def pass_local_rrefs() -> None:
        rref = rpc.RRef(40)
        equal(rpc.rpc_sync(dst, add_rref_to_value, args=(rref, 50)), 90)
        equal(rpc.rpc_async(dst, add_rref_to_value, args=(rref, 50)).wait(), 90)
        equal(rpc.remote(dst, add_rref_to_value, args=(rref, 50)).to_here(), 90)

    def remote_same_worker() -> None:
        a = rpc.remote(dst, torch.add, args=(torch.ones(n, n), 2))
        b = rpc.remote(dst, torch.add, args=(torch.ones(n, n), 1))
        c = rpc.remote(dst, my_rref_function, args=(a, b))
        equal(c.to_here(), torch.ones(n, n) + 4)

    def call_method_on_rref_() -> None:
        vals = [10, 2, 5, 7]
        rref = rpc.remote(dst, MyClass, args=(vals[0],))
        rpc.rpc_sync(rref.owner(), call_method_on_rref, args=(MyClass.increment_value, rref, vals[1]))
        rpc.rpc_async(rref.owner(), call_method_on_rref, args=(MyClass.increment_value, rref, vals[2])).wait()
        rpc.remote(rref.owner(), call_method_on_rref, args=(MyClass.increment_value, rref, vals[3])).to_here()
        equal(rpc.rpc_sync(dst, call_method_on_rref, args=(MyClass.get_value, rref)), sum(vals))

    def self_py_udf_remote() -> None:
        equal(rpc.remote(me, my_function, args=(ones, 1, 3)).to_here(), ones + 4)

    def self_remote_rref_as_rpc_arg() -> None:
        x, y, z = ones, 1, 3
        rref = rpc.remote(me, my_function, args=(x, y, z))
        fut = rpc.rpc_async(dst, add_rref_to_value, args=(rref, x))
        ret = rpc.rpc_sync(dst, add_rref_to_value, args=(rref, x + y))
        equal(ret, x + y + z + x + y)
        equal(fut.wait(), x + y + z + x)

    def self_remote_rref_as_remote_arg() -> None:
        x, y, z = ones, 1, 3
        rref = rpc.remote(me, my_function, args=(x, y, z))
        equal(rpc.remote(dst, add_rref_to_value, args=(rref, x)).to_here(), x + y + z + x)

    return run_checks(
        {
            "test_builtin_remote_ret": builtin_remote_ret,
            "test_builtin_remote_self": builtin_remote_self,
            "test_multi_builtin_remote_ret": multi_builtin_remote_ret,
            "test_py_udf_remote": py_udf_remote,
            "test_multi_py_udf_remote": multi_py_udf_remote,
            "test_py_rref_args": py_rref_args,
            "test_py_rref_args_user_share": py_rref_args_user_share,
            "test_py_rpc_rref_args": py_rpc_rref_args,
            "test_nested_remote": nested_remote_,
            "test_nested_rref": nested_rref_,
            "test_nested_rref_stress": nested_rref_stress,
            "test_multi_layer_nested_async_rpc": multi_layer_nested_async,
            "test_remote_with_exception": remote_with_exception,
            "test_rpc_return_rref": rpc_return_rref_,
            "test_rref_forward_chain": forward_chain,
            "test_local_rref_no_fork": local_rref_no_fork,
            "test_return_local_rrefs": return_local_rrefs,
            "test_owner_equality": owner_equality,
            "test_pass_local_rrefs": pass_local_rrefs,
            "test_remote_same_worker": remote_same_worker,
            "test_call_method_on_rref": call_method_on_rref_,
            "test_self_py_udf_remote": self_py_udf_remote,
            "test_self_remote_rref_as_rpc_arg": self_remote_rref_as_rpc_arg,
            "test_self_remote_rref_as_remote_arg": self_remote_rref_as_remote_arg,
        }
    )


def scenario_uneven(rpc: Any, rank: int, world: int) -> Dict[str, Any]:
    # test_graceful_shutdown_with_uneven_workload: worker0 loads worker1, then worker2;
    # a graceful shutdown must not have let worker2 go in between.
    def uneven() -> None:
        if rank != 0:
            return
        x = torch.ones(100, 100)
        for dst in ("worker1", "worker2"):
            futs = [rpc.rpc_async(dst, heavy_rpc, args=(x,)) for _ in range(30)]
            assert all(f.wait() == 0 for f in torch.futures.collect_all(futs).wait())

    return run_checks({"test_graceful_shutdown_with_uneven_workload": uneven})


SCENARIOS = {"calls": scenario_calls, "rrefs": scenario_rrefs, "uneven": scenario_uneven}


def child_main(argv: List[str]) -> None:
    """A worker of the port: every rank runs the scenario (torch's tests run on each rank),
    prints what it saw; a rank other than 0 exits 1 on a failed check, so the test sees it."""
    scenario, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    import rdzv.rpc as rpc

    init = f"tcp://127.0.0.1:{port}"
    if scenario in ("shutdown_then_rpc", "local_shutdown", "default_timeout", "world_size_one"):
        seen = lifecycle(rpc, scenario, rank, world, init)
        print(json.dumps({"rank": rank, "result": seen}), flush=True)
        sys.exit(0 if rank == 0 or all(v is True for v in seen.values()) else 1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=60, num_worker_threads=8)
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world, rpc_backend_options=options)
    seen = SCENARIOS[scenario](rpc, rank, world)
    rpc.shutdown()
    print(json.dumps({"rank": rank, "result": seen}), flush=True)
    if rank != 0 and not all(v is True for v in seen.values()):
        print(json.dumps(seen), file=sys.stderr)
        sys.exit(1)


def lifecycle(rpc: Any, scenario: str, rank: int, world: int, init: str) -> Dict[str, Any]:
    """torch's tests that set up RPC themselves (``dist_init(setup_rpc=False)``)."""

    def options(timeout: float = 60) -> Any:
        return rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=timeout)

    def shutdown_followed_by_rpc() -> None:
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world, rpc_backend_options=options())
        n = rank + 1
        dst = worker_name(n % world)
        equal(rpc.rpc_sync(dst, torch.add, args=(torch.ones(n, n), torch.ones(n, n))), torch.ones(n, n) * 2)
        rpc.shutdown()
        try:
            rpc.rpc_sync(dst, torch.add, args=(torch.ones(n, n), torch.ones(n, n)))
        except RuntimeError as e:
            assert str(e).startswith("RPC has not been initialized"), str(e)
        else:
            raise AssertionError("a call after shutdown did not raise")

    def local_shutdown() -> None:
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world, rpc_backend_options=options())
        rpc.shutdown(graceful=False)

    def set_and_get_default_rpc_timeout() -> None:
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world, rpc_backend_options=options(0.5))
        equal(rpc.get_rpc_timeout(), 0.5)
        rpc.shutdown()

    def world_size_one() -> None:
        if rank != 0:
            return
        rpc.init_rpc("me", rank=0, world_size=1, rpc_backend_options=options())
        a = torch.ones(2, 2)
        equal(rpc.rpc_sync("me", my_tensor_function, args=(a, a)), a * 2)
        equal(rpc.rpc_async("me", my_tensor_function, args=(a, a)).wait(), a * 2)
        equal(rpc.remote("me", my_tensor_function, args=(a, a)).to_here(), a * 2)
        rpc.shutdown()

    checks = {
        "shutdown_then_rpc": {"test_shutdown_followed_by_rpc": shutdown_followed_by_rpc},
        "local_shutdown": {"test_local_shutdown": local_shutdown},
        "default_timeout": {"test_set_and_get_default_rpc_timeout": set_and_get_default_rpc_timeout},
        "world_size_one": {"test_world_size_one": world_size_one},
    }[scenario]
    return run_checks(checks)


# --- The tests. ---------------------------------------------------------------------


def run_port(children: Any, scenario: str, world: int = WORLD) -> Dict[str, Any]:
    return test_rpc.run_group(children, scenario, world, timeout=240, module="test_rpc_torch_port")["result"]


def test_torch_rpc_test_calls(children: Any) -> None:
    assert_all_true(run_port(children, "calls"))


def test_torch_rpc_test_rrefs(children: Any) -> None:
    assert_all_true(run_port(children, "rrefs"))


def test_torch_rpc_test_graceful_shutdown_with_uneven_workload(children: Any) -> None:
    assert_all_true(run_port(children, "uneven"))


@pytest.mark.parametrize("scenario", ["shutdown_then_rpc", "local_shutdown", "default_timeout", "world_size_one"])
def test_torch_rpc_test_lifecycle(children: Any, scenario: str) -> None:
    world = 1 if scenario == "world_size_one" else 2
    assert_all_true(run_port(children, scenario, world))
