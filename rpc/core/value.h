// rpc::ValueTraits<T>: how a C++ type crosses an RPC as a c10::IValue.
//
// Supported out of the box: at::Tensor, bool, integers, floating point,
// std::string (and string literals as arguments), c10::IValue, and
// std::vector / std::tuple of these. Higher layers add types (e.g. RRef) by
// specializing ValueTraits. from_ivalue throws TypeMismatch on a wrong type.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace ddprpc::rpc {

// Thrown by ValueTraits<T>::from_ivalue; the caller adds which call and
// argument it was.
class TypeMismatch : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A short name of an IValue's type for error messages ("Tensor", "int", ...).
std::string ivalue_type_name(const c10::IValue& value);

[[noreturn]] void throw_type_mismatch(const char* expected,
                                      const c10::IValue& got);

template <typename T, typename Enable = void>
struct ValueTraits;  // static c10::IValue to_ivalue(T); static T from_ivalue(const c10::IValue&)

template <>
struct ValueTraits<c10::IValue> {
  static c10::IValue to_ivalue(c10::IValue v) { return v; }
  static c10::IValue from_ivalue(const c10::IValue& v) { return v; }
};

template <>
struct ValueTraits<at::Tensor> {
  static c10::IValue to_ivalue(at::Tensor t) { return c10::IValue(std::move(t)); }
  static at::Tensor from_ivalue(const c10::IValue& v) {
    if (!v.isTensor()) throw_type_mismatch("Tensor", v);
    return v.toTensor();
  }
};

template <>
struct ValueTraits<bool> {
  static c10::IValue to_ivalue(bool b) { return c10::IValue(b); }
  static bool from_ivalue(const c10::IValue& v) {
    if (!v.isBool()) throw_type_mismatch("bool", v);
    return v.toBool();
  }
};

template <typename T>
struct ValueTraits<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>> {
  static c10::IValue to_ivalue(T i) { return c10::IValue(static_cast<int64_t>(i)); }
  static T from_ivalue(const c10::IValue& v) {
    if (!v.isInt()) throw_type_mismatch("int", v);
    return static_cast<T>(v.toInt());
  }
};

template <typename T>
struct ValueTraits<T, std::enable_if_t<std::is_floating_point_v<T>>> {
  static c10::IValue to_ivalue(T d) { return c10::IValue(static_cast<double>(d)); }
  static T from_ivalue(const c10::IValue& v) {
    if (v.isDouble()) return static_cast<T>(v.toDouble());
    if (v.isInt()) return static_cast<T>(v.toInt());
    throw_type_mismatch("float", v);
  }
};

template <>
struct ValueTraits<std::string> {
  static c10::IValue to_ivalue(std::string s) { return c10::IValue(std::move(s)); }
  static std::string from_ivalue(const c10::IValue& v) {
    if (!v.isString()) throw_type_mismatch("str", v);
    return v.toStringRef();
  }
};

template <>
struct ValueTraits<const char*> {
  static c10::IValue to_ivalue(const char* s) { return c10::IValue(std::string(s)); }
};

template <typename T>
struct ValueTraits<std::vector<T>> {
  static c10::IValue to_ivalue(std::vector<T> items) {
    if constexpr (std::is_same_v<T, at::Tensor>) {
      return c10::IValue(c10::List<at::Tensor>(std::move(items)));
    } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double> ||
                         std::is_same_v<T, std::string>) {
      return c10::IValue(c10::List<T>(std::move(items)));
    } else {
      c10::impl::GenericList list(c10::AnyType::get());
      list.reserve(items.size());
      for (auto& item : items) list.push_back(ValueTraits<T>::to_ivalue(std::move(item)));
      return c10::IValue(std::move(list));
    }
  }
  static std::vector<T> from_ivalue(const c10::IValue& v) {
    std::vector<T> out;
    if (v.isList()) {
      auto list = v.toListRef();
      out.reserve(list.size());
      for (const auto& item : list) out.push_back(ValueTraits<T>::from_ivalue(item));
    } else if (v.isTuple()) {
      const auto& elems = v.toTupleRef().elements();
      out.reserve(elems.size());
      for (const auto& item : elems) out.push_back(ValueTraits<T>::from_ivalue(item));
    } else {
      throw_type_mismatch("list", v);
    }
    return out;
  }
};

template <typename... Ts>
struct ValueTraits<std::tuple<Ts...>> {
  static c10::IValue to_ivalue(std::tuple<Ts...> t) {
    return std::apply(
        [](auto&&... xs) {
          return c10::IValue(c10::ivalue::Tuple::create(
              std::vector<c10::IValue>{ValueTraits<std::decay_t<decltype(xs)>>::to_ivalue(
                  std::forward<decltype(xs)>(xs))...}));
        },
        std::move(t));
  }
  static std::tuple<Ts...> from_ivalue(const c10::IValue& v) {
    if (!v.isTuple()) throw_type_mismatch("tuple", v);
    const auto& elems = v.toTupleRef().elements();
    if (elems.size() != sizeof...(Ts)) {
      throw TypeMismatch("expected a tuple of " + std::to_string(sizeof...(Ts)) +
                         " elements, got " + std::to_string(elems.size()));
    }
    return from_elements(elems, std::index_sequence_for<Ts...>{});
  }

 private:
  template <typename Elems, size_t... I>
  static std::tuple<Ts...> from_elements(const Elems& elems, std::index_sequence<I...>) {
    return std::tuple<Ts...>(ValueTraits<Ts>::from_ivalue(elems[I])...);
  }
};

// Converts a C++ value to an IValue (decaying references and arrays).
template <typename T>
c10::IValue to_ivalue(T&& value) {
  return ValueTraits<std::decay_t<T>>::to_ivalue(std::forward<T>(value));
}

template <typename T>
T from_ivalue(const c10::IValue& value) {
  return ValueTraits<T>::from_ivalue(value);
}

}  // namespace ddprpc::rpc
