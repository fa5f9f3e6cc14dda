#include "rpc/core/value.h"

namespace ddprpc::rpc {

std::string ivalue_type_name(const c10::IValue& v) {
  if (v.isNone()) return "None";
  if (v.isTensor()) return "Tensor";
  if (v.isBool()) return "bool";
  if (v.isInt()) return "int";
  if (v.isDouble()) return "float";
  if (v.isString()) return "str";
  if (v.isTuple()) return "tuple";
  if (v.isList()) return "list";
  return v.tagKind();
}

void throw_type_mismatch(const char* expected, const c10::IValue& got) {
  throw TypeMismatch(std::string("expected ") + expected + ", got " + ivalue_type_name(got));
}

}  // namespace ddprpc::rpc
