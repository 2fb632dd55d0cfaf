#include <forkpool/ipc/codec.hpp>

#include <fcntl.h>

namespace forkpool {

std::uint32_t Attachments::add_copy(int fd) {
  copies_.push_back(duplicate_fd(fd));
  fds_.push_back(copies_.back().get());
  return static_cast<std::uint32_t>(fds_.size() - 1);
}

std::uint32_t Attachments::add_borrowed(int fd, std::shared_ptr<const void> owner) {
  owners_.push_back(std::move(owner));
  fds_.push_back(fd);
  return static_cast<std::uint32_t>(fds_.size() - 1);
}

std::size_t Reader::read_count(std::size_t min_element_size, const char* what) {
  return check_count(read<std::uint64_t>(), min_element_size, what);
}

std::size_t Reader::check_count(std::uint64_t count, std::size_t min_element_size, const char* what) const {
  if (min_element_size > 0 && count > remaining() / min_element_size)
    fail(std::string(what) + " claims " + std::to_string(count) + " elements but only " + std::to_string(remaining()) +
         " bytes remain");
  return static_cast<std::size_t>(count);
}

UniqueFd Reader::take_fd(std::uint32_t index) {
  if (index >= fds_.size())
    fail("descriptor index " + std::to_string(index) + " but the message carries " + std::to_string(fds_.size()));
  if (!fds_[index]) fail("descriptor " + std::to_string(index) + " is used twice");
  return std::move(fds_[index]);
}

UniqueFd Reader::read_fd() { return take_fd(read<std::uint32_t>()); }

void Writer::write_fd(int fd) { write(attach_fd(fd)); }

void Writer::write_fd(int fd, std::shared_ptr<const void> owner) { write(attach_fd(fd, std::move(owner))); }

void Reader::fail(const std::string& what) const {
  throw ProtocolError("forkpool: malformed message at byte " + std::to_string(offset_) + ": " + what);
}

}  // namespace forkpool
