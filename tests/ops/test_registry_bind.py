"""OpSpec.bind (every validated call and every profiled one goes through it) binds by hand for speed:
it must give what Python's own binding gives, and raise TypeError where that raises."""

import inspect
import random

import pytest

from kiln.ops import all_ops


def _python_bind(spec, args, kwargs):
    bound = spec.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


@pytest.mark.parametrize("name", sorted(all_ops()))
def test_bind_equals_pythons_binding_and_raises_where_it_raises(name):
    spec = all_ops()[name]
    parameters = list(spec.signature.parameters.values())
    rng = random.Random(name)
    raised = 0
    for _ in range(60):
        values = {p.name: object() for p in parameters}
        split = rng.randint(0, len(parameters))
        args = tuple(values[p.name] for p in parameters[:split])
        kwargs = {
            p.name: values[p.name]
            for p in parameters[split:]
            if p.default is inspect.Parameter.empty or rng.random() < 0.5
        }
        mistake = rng.random()
        if mistake < 0.1:
            kwargs["no_such_argument"] = object()
        elif mistake < 0.2 and args:
            kwargs[parameters[0].name] = object()  # given twice
        elif mistake < 0.3 and kwargs:
            kwargs.pop(next(iter(kwargs)))  # maybe a required one missing
        elif mistake < 0.35:
            args = (*args, *(object() for _ in range(len(parameters) + 1 - len(args))))  # too many
            kwargs = {}
        try:
            want = _python_bind(spec, args, kwargs)
        except TypeError:
            raised += 1
            with pytest.raises(TypeError):
                spec.bind(args, kwargs)
            continue
        got = spec.bind(args, kwargs)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))
    assert raised > 0
