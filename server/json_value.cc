// Recursive-descent JSON parser; errors carry the byte offset.
#include "json_value.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace attngrad::server {
namespace {

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  absl::StatusOr<JsonValue> Document() {
    JsonValue value;
    absl::Status status = Value(0, &value);
    if (!status.ok()) return status;
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing characters after the JSON value");
    return value;
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON at byte ", pos_, ": ", what));
  }

  void SkipSpace() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(std::string_view literal) {
    if (text_.substr(pos_, literal.size()) != literal) return false;
    pos_ += literal.size();
    return true;
  }

  absl::Status Value(int depth, JsonValue* out) {
    if (depth > 64) return Error("nested too deeply");
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end");
    const char c = text_[pos_];
    if (c == '{') return Object(depth, out);
    if (c == '[') return Array(depth, out);
    if (c == '"') {
      out->kind = JsonValue::Kind::kString;
      return String(&out->text);
    }
    if (Consume("true")) {
      out->kind = JsonValue::Kind::kBool;
      out->boolean = true;
      return absl::OkStatus();
    }
    if (Consume("false")) {
      out->kind = JsonValue::Kind::kBool;
      return absl::OkStatus();
    }
    if (Consume("null")) {
      out->kind = JsonValue::Kind::kNull;
      return absl::OkStatus();
    }
    if (c == '-' || (c >= '0' && c <= '9')) return Number(out);
    return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  absl::Status Number(JsonValue* out) {
    const std::size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const std::size_t begin = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ > begin;
    };
    if (!digits()) return Error("malformed number");
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      if (!digits()) return Error("malformed number");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (!digits()) return Error("malformed number");
    }
    out->kind = JsonValue::Kind::kNumber;
    out->text = std::string(text_.substr(start, pos_ - start));
    out->number = std::strtod(out->text.c_str(), nullptr);
    return absl::OkStatus();
  }

  static void AppendUtf8(unsigned code_point, std::string* out) {
    if (code_point < 0x80) {
      out->push_back(static_cast<char>(code_point));
    } else if (code_point < 0x800) {
      out->push_back(static_cast<char>(0xc0 | (code_point >> 6)));
      out->push_back(static_cast<char>(0x80 | (code_point & 0x3f)));
    } else if (code_point < 0x10000) {
      out->push_back(static_cast<char>(0xe0 | (code_point >> 12)));
      out->push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (code_point & 0x3f)));
    } else {
      out->push_back(static_cast<char>(0xf0 | (code_point >> 18)));
      out->push_back(static_cast<char>(0x80 | ((code_point >> 12) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (code_point & 0x3f)));
    }
  }

  absl::Status Hex4(unsigned* value) {
    if (pos_ + 4 > text_.size()) return Error("truncated \\u escape");
    *value = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      *value <<= 4;
      if (c >= '0' && c <= '9') *value |= c - '0';
      else if (c >= 'a' && c <= 'f') *value |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') *value |= c - 'A' + 10;
      else return Error("bad \\u escape");
    }
    return absl::OkStatus();
  }

  absl::Status String(std::string* out) {
    ++pos_;  // opening quote
    out->clear();
    while (true) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return absl::OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) return Error("unterminated escape");
      const char escape = text_[pos_++];
      switch (escape) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          unsigned code_point;
          absl::Status status = Hex4(&code_point);
          if (!status.ok()) return status;
          if (code_point >= 0xd800 && code_point < 0xdc00 && Consume("\\u")) {
            unsigned low;
            status = Hex4(&low);
            if (!status.ok()) return status;
            if (low < 0xdc00 || low >= 0xe000) return Error("bad surrogate pair");
            code_point = 0x10000 + ((code_point - 0xd800) << 10) + (low - 0xdc00);
          }
          AppendUtf8(code_point, out);
          break;
        }
        default: return Error("unknown escape");
      }
    }
  }

  absl::Status Array(int depth, JsonValue* out) {
    ++pos_;
    out->kind = JsonValue::Kind::kArray;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      out->array.emplace_back();
      absl::Status status = Value(depth + 1, &out->array.back());
      if (!status.ok()) return status;
      SkipSpace();
      if (pos_ >= text_.size()) return Error("unterminated array");
      const char c = text_[pos_++];
      if (c == ']') return absl::OkStatus();
      if (c != ',') return Error("expected ',' or ']' in array");
    }
  }

  absl::Status Object(int depth, JsonValue* out) {
    ++pos_;
    out->kind = JsonValue::Kind::kObject;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a member name");
      std::string key;
      absl::Status status = String(&key);
      if (!status.ok()) return status;
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      JsonValue value;
      status = Value(depth + 1, &value);
      if (!status.ok()) return status;
      out->object[key] = std::move(value);
      SkipSpace();
      if (pos_ >= text_.size()) return Error("unterminated object");
      const char c = text_[pos_++];
      if (c == '}') return absl::OkStatus();
      if (c != ',') return Error("expected ',' or '}' in object");
    }
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

}  // namespace

const JsonValue* JsonValue::Find(const std::string& key) const {
  if (kind != Kind::kObject) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &it->second;
}

absl::StatusOr<JsonValue> ParseJson(std::string_view text) { return Parser(text).Document(); }

}  // namespace attngrad::server
