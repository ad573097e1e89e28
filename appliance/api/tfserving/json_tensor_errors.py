"""TF Serving's words for a :predict body it refuses (util/json_tensor.cc), on the error path only.

appliance/api/tfserving/json_format.py decodes a body straight into numpy and decides what
it accepts. When it refuses one, ``predict_error(doc, signature)`` walks the parsed body
as TF Serving's ``FillPredictRequestFromJson`` does (``FillTensorMapFromInstancesList``,
``FillTensorMapFromInputsMap``, ``AddInstanceItem``, ``FillTensorProto``,
``AddValueToTensor``) and returns the first error TF Serving would report, word for word;
None when TF Serving would take the body (the refusal is then one of ours: a limit, more
than 64 dimensions).

Values are shown as TF Serving shows them (``JsonValueToDebugString``): rapidjson's
PrettyWriter with single-line arrays, four-space indents in objects, doubles as rapidjson's
dtoa writes them (``1.0``, ``1e21``, ``1e-7``), cut after 256 bytes, and nothing at all from
a NaN or an infinity on (the writer refuses them and stops).

The walk is Python, but a list of leaves is checked in one pass of C-level built-ins, so
a refused body costs about what parsing it did.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard, cast

from appliance.core.json_types import JSONArray, JSONObject, JSONValue

from runtimes import SignatureInfo

from appliance.api.tfserving.b64 import b64_decode, url_safe_hint
from appliance.api.tfserving.service import data_type_string
from appliance.core.errors import InvalidArgument

MAX_DEBUG_BYTES = 256  # json_tensor.cc kMaxJsonDebugStringBytes
INVALID, UNIMPLEMENTED = "INVALID_ARGUMENT", "UNIMPLEMENTED"  # absl::Status::ToString prefixes
_INT32, _INT64, _UINT32, _UINT64 = (-(1 << 31), 1 << 31), (-(1 << 63), 1 << 63), (0, 1 << 32), (0, 1 << 64)
# AddValueToTensor: DataTypeString -> what rapidjson's Is*() accepts (Python type, integer range)
_ACCEPTS: dict[str, tuple[tuple[type, ...], tuple[int, int] | None]] = {
    "float": ((int, float), None), "double": ((int, float), None),
    "int32": ((int,), _INT32), "int16": ((int,), _INT32), "int8": ((int,), _INT32), "uint8": ((int,), _INT32),
    "int64": ((int,), _INT64), "uint32": ((int,), _UINT32), "uint64": ((int,), _UINT64),
    "string": ((str,), None), "bool": ((bool,), None),
}


class _Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    def status(self) -> str:  # Status::ToString, as TF Serving nests one error in another
        return f"{self.code}: {self.message}"


def predict_error(doc: JSONObject, signature: SignatureInfo) -> str | None:
    """TF Serving's error for this :predict body on ``signature`` (see module docstring)."""
    infos = {name: data_type_string(spec.dtype) for name, spec in signature.inputs.items()}
    try:
        if not infos:
            raise _Refused(INVALID, f"Failed to get input map for signature: {doc.get('signature_name') or 'DEFAULT'}")
        if "instances" in doc:
            if "inputs" in doc:
                raise _Refused(INVALID, format_error(doc, "Not formatted correctly expecting only one of 'inputs' or "
                                                          "'instances' keys to exist "))
            rows = doc["instances"]
            if not isinstance(rows, list):
                raise _Refused(INVALID, format_error(doc, "Expecting 'instances' to be an list/array"))
            if not rows:
                raise _Refused(INVALID, format_error(doc, "No values in 'instances' array"))
            _instances(rows, infos)
        elif "inputs" in doc:
            _inputs(doc["inputs"], infos)
        else:
            raise _Refused(INVALID, "Missing 'inputs' or 'instances' key")
    except _Refused as refused:
        return refused.message
    return None


def format_error(value: JSONValue, text: str) -> str:
    """json_tensor.cc FormatError: the value, then what is wrong with it."""
    return f"JSON Value: {debug_string(value)} {text}"


def _is_b64(value: JSONValue) -> bool:  # IsValBase64Object
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get("b64"), str)


def _is_element_object(value: JSONValue) -> TypeGuard[JSONObject]:
    return isinstance(value, dict) and not _is_b64(value)


def _instances(rows: JSONArray, infos: dict[str, str]) -> None:
    """FillTensorMapFromInstancesList."""
    if not isinstance(rows[0], dict) and len(infos) > 1:
        raise _Refused(INVALID, "instances is a plain list, but expecting list of objects as multiple input tensors "
                                "required as per tensorinfo_map")
    objects = _is_element_object(rows[0])
    names = sorted(infos)
    seen: dict[str, tuple[int, list[int]]] = {}  # name -> (values, shape) of its first instance
    for n, row in enumerate(rows):
        if objects:
            if not _is_element_object(row):
                raise _Refused(INVALID, f"Expecting object but got list at item {n} of input list")
            for key, item in row.items():
                try:
                    _instance_item(item, key, infos, seen)
                except _Refused as refused:
                    raise _Refused(INVALID, f"Failed to process element: {n} key: {key} of 'instances' list. "
                                            f"Error: {refused.status()}") from None
            if sorted(row) != names:
                raise _Refused(INVALID, f"Failed to process element: {n} of 'instances' list. JSON object: "
                                        f"{debug_string(row)} keys must be equal to: {','.join(names)}")
        else:
            if _is_element_object(row):
                raise _Refused(INVALID, f"Expecting value/list but got object at item {n} of input list")
            try:
                _instance_item(row, next(iter(infos)), infos, seen)
            except _Refused as refused:
                raise _Refused(INVALID, f"Failed to process element: {n} of 'instances' list. "
                                        f"Error: {refused.status()}") from None


def _instance_item(item: JSONValue, name: str, infos: dict[str, str], seen: dict[str, tuple[int, list[int]]]) -> None:
    """AddInstanceItem: every instance of an input has the first one's size and shape."""
    if name not in infos:
        raise _Refused(INVALID, f"JSON object: does not have named input: {name}")
    shape = _dense_shape(item)
    size = _fill(item, 0, shape, infos[name])
    if name not in seen:
        seen[name] = (size, shape)
    elif seen[name][0] != size:
        raise _Refused(INVALID, f"Expecting tensor size: {seen[name][0]} but got: {size}")
    elif seen[name][1] != shape:
        raise _Refused(INVALID, f"Expecting shape {_shape_text(seen[name][1])} but got: {_shape_text(shape)}")


def _inputs(value: JSONValue, infos: dict[str, str]) -> None:
    """FillTensorMapFromInputsMap: errors come out as they are, not wrapped."""
    if not isinstance(value, dict) or _is_b64(value):
        if len(infos) > 1:
            raise _Refused(INVALID, "inputs is a plain value/list, but expecting an object as multiple input tensors "
                                    "required as per tensorinfo_map")
        _fill(value, 0, _dense_shape(value), next(iter(infos.values())))
        return
    for name, dtype in infos.items():
        if name not in value:
            raise _Refused(INVALID, f"Missing named input: {name} in 'inputs' object.")
        _fill(value[name], 0, _dense_shape(value[name]), dtype)


def _dense_shape(value: JSONValue) -> list[int]:
    """GetDenseTensorShape: the lengths along the first elements."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _shape_text(shape: list[int]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _fill(value: JSONValue, level: int, shape: list[int], dtype: str) -> int:
    """FillTensorProto: the number of values, or the first error in document order."""
    rank = len(shape)
    if not isinstance(value, list):
        if level != rank:
            raise _Refused(INVALID, f"JSON Value: {debug_string(value)} found at incorrect level: {level + 1} in the "
                                    f"JSON DOM. Expected at level: {rank}")
        _value(value, dtype)
        return 1
    if level >= rank:
        raise _Refused(INVALID, f"Encountered list at unexpected level: {level} expected < {rank}")
    if len(value) != shape[level]:
        raise _Refused(INVALID, f"Encountered list at unexpected size: {len(value)} at level: {level} expected size: "
                                f"{shape[level]}")
    if level == rank - 1 and _all_accepted(value, dtype):  # a list of good leaves, checked at C speed
        return len(value)
    return sum(_fill(v, level + 1, shape, dtype) for v in value)


def _all_accepted(values: JSONArray, dtype: str) -> bool:
    kinds, bounds = _ACCEPTS.get(dtype, ((), None))
    if not values or not set(map(type, values)) <= set(kinds):
        return False
    if bounds is None:
        return True
    ints = cast("list[int]", values)  # checked just above: a dtype with bounds accepts (int,) only
    return bounds[0] <= min(ints) and max(ints) < bounds[1]


def _value(value: JSONValue, dtype: str) -> None:
    """AddValueToTensor, and a {"b64": ...} object for a string input."""
    if isinstance(value, dict):
        if dtype != "string":
            raise _type_error(value, dtype)
        if not _is_b64(value):
            raise _Refused(INVALID, f"JSON Value: {debug_string(value)} not formatted correctly for base64 data")
        try:
            b64_decode(value, "")  # the decoder's own rule: absl::Base64Unescape's
        except InvalidArgument:  # TF Serving's words, and ours where the text looks URL-safe
            raise _Refused(INVALID, "Unable to base64 decode" + url_safe_hint(str(value["b64"]))) from None
        return
    accepts = _ACCEPTS.get(dtype)
    if accepts is None:
        raise _Refused(UNIMPLEMENTED, f"Conversion of JSON Value: {debug_string(value)} to type: {dtype}")
    kinds, bounds = accepts
    if type(value) not in kinds or bounds is not None and not (isinstance(value, int) and bounds[0] <= value < bounds[1]):
        raise _type_error(value, dtype)


def _type_error(value: JSONValue, dtype: str) -> _Refused:
    return _Refused(INVALID, f"JSON Value: {debug_string(value)} Type: {_json_type(value)} is not of expected type: "
                             f"{dtype}")


def _json_type(value: JSONValue) -> str:
    """JsonTypeString."""
    if value is None:
        return "Null"
    if isinstance(value, bool):
        return "True" if value else "False"
    names: dict[type, str] = {dict: "Object", list: "Array", str: "String"}
    return names.get(type(value), "Number")


# --- JsonValueToDebugString: rapidjson's PrettyWriter, kFormatSingleLineArray, 256 bytes ------
_ESCAPE = {i: f"\\u{i:04X}" for i in range(0x20)}
_ESCAPE.update({ord('"'): '\\"', ord("\\"): "\\\\", 8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r"})


def debug_string(value: JSONValue) -> str:
    writer = _PrettyWriter(MAX_DEBUG_BYTES)
    writer.accept(value)
    return "".join(writer.out)


class _PrettyWriter:
    """prettywriter.h's output, behind json_tensor.cc's JsonWriterWithLimit: every event is
    written only while fewer than ``limit`` bytes are out, and the first refused one ends it."""

    def __init__(self, limit: int):
        self.out: list[str] = []
        self.size, self.limit = 0, limit
        self.levels: list[list[Any]] = []  # [in_array, values written]

    def put(self, text: str) -> None:
        self.out.append(text)
        self.size += len(text.encode("utf-8", "surrogatepass"))

    def room(self) -> bool:
        return self.size < self.limit

    def prefix(self) -> None:
        """PrettyPrefix."""
        if not self.levels:
            return
        level = self.levels[-1]
        if level[0]:
            if level[1]:
                self.put(", ")
        else:
            if level[1]:
                self.put(",\n" if level[1] % 2 == 0 else ": ")
            else:
                self.put("\n")
            if level[1] % 2 == 0:
                self.put(" " * 4 * len(self.levels))
        level[1] += 1

    def accept(self, value: JSONValue) -> bool:
        """GenericValue::Accept: False once the writer refuses an event."""
        if not self.room():
            return False
        if isinstance(value, (dict, list)):
            return self.container(value)
        self.prefix()
        if isinstance(value, str):
            self.put('"' + value.translate(_ESCAPE) + '"')
        elif value is None or isinstance(value, bool):
            self.put("null" if value is None else "true" if value else "false")
        elif isinstance(value, int):
            self.put(str(value))
        elif math.isfinite(value):
            self.put(dtoa(as_rapidjson_reads(value)))
        else:
            return False  # Writer::WriteDouble refuses NaN and infinities (kWriteNanAndInfFlag is off)
        return True

    def container(self, value: JSONObject | JSONArray) -> bool:
        is_list = isinstance(value, list)
        self.prefix()
        self.levels.append([is_list, 0])
        self.put("[" if is_list else "{")
        if isinstance(value, list):
            for item in value:
                if not self.accept(item):
                    return False
        else:
            for key, member in value.items():
                if not self.room():
                    return False
                self.prefix()  # the key
                self.put('"' + key.translate(_ESCAPE) + '"')
                if not self.accept(member):
                    return False
        if not self.room():
            return False
        written = self.levels.pop()[1]
        if written and not is_list:
            self.put("\n" + " " * 4 * len(self.levels))
        self.put("]" if is_list else "}")
        return True


def as_rapidjson_reads(value: float) -> float:
    """The double rapidjson 1.1.0 reads for ``value``'s shortest decimal text: without
    kParseFullPrecisionFlag, ParseNumber keeps at most 17 significant digits and scales them by
    one table power of ten (StrtodNormalPrecision), so "1.2345e-300" reads as
    1.2345000000000001e-300. (The client's own text may have had more digits: not kept.)"""
    mantissa, _, exponent = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    significand, significant, exp_frac = int(whole), len(whole.lstrip("0")) - 1 if whole != "0" else 0, 0
    digits = iter(fraction)
    for k in digits:  # the integer fast path, up to 2^53 - 1
        if significand > 0x1FFFFFFFFFFFFF:
            digits = iter(k + "".join(digits))
            break
        significand, exp_frac = significand * 10 + int(k), exp_frac - 1
        significant += significand != 0
    d = float(significand)
    for k in digits:
        if significant < 17:
            d, exp_frac = d * 10 + int(k), exp_frac - 1
            significant += d > 0
    p = int(exponent or 0) + exp_frac
    if p < -308:  # StrtodNormalPrecision: two steps, so that 10^p is never 0
        d, p = _fast_path(d, -308), p + 308
    return math.copysign(_fast_path(d, p), value)


def _fast_path(significand: float, exp: int) -> float:
    if exp < -308:
        return 0.0
    return significand * float(f"1e{exp}") if exp >= 0 else significand / float(f"1e{-exp}")


def dtoa(value: float) -> str:
    """rapidjson's internal::dtoa (maxDecimalPlaces 324): Prettify over the shortest digits.
    (rapidjson's Grisu2 digits are the shortest that read back in all but rare cases.)"""
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    mantissa, _, exponent = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    k = int(exponent or 0) - len(fraction)
    stripped = digits.rstrip("0")
    k += len(digits) - len(stripped)
    return sign + _prettify(stripped, k)


def _prettify(digits: str, k: int) -> str:
    """dtoa.h Prettify: ``digits`` x 10^k."""
    length = len(digits)
    kk = length + k  # 10^(kk-1) <= v < 10^kk
    if 0 <= k and kk <= 21:
        return digits + "0" * k + ".0"
    if 0 < kk <= 21:
        return digits[:kk] + "." + digits[kk:]
    if -6 < kk <= 0:
        return "0." + "0" * -kk + digits
    if kk < -324:
        return "0.0"
    if length == 1:
        return f"{digits}e{kk - 1}"
    return f"{digits[0]}.{digits[1:]}e{kk - 1}"


__all__ = ["debug_string", "dtoa", "format_error", "predict_error"]
