#include <forkpool/mpi/private/protocol.hpp>

#include <forkpool/runtime/error.hpp>
#include <forkpool/runtime/private/describe_exception.hpp>

namespace forkpool::mpi::detail {
namespace {

enum ErrorType : std::uint8_t {
  kOther = 0,  // any other exception: an Error with its description
  kRemoteError,
  kInitializerError,
  kWorkerLost,
  kPoolTerminated,
  kPoolClosed,
  kCancelled,
  kTimeoutError,
  kProtocolError,
  kError,
};

}  // namespace

ErrorRecord record_error(const std::exception_ptr& error) {
  ErrorRecord record;
  try {
    std::rethrow_exception(error);
  } catch (const RemoteError& e) {
    record = {kRemoteError, e.type_name(), e.message(), e.worker_pid(), 0, 0};
  } catch (const InitializerError& e) {
    record = {kInitializerError, e.type_name(), e.message(), e.worker_pid(), 0, 0};
  } catch (const WorkerLost& e) {
    record = {kWorkerLost, {}, e.what(), e.pid(), e.exit_code(), e.signal()};
  } catch (const PoolTerminated& e) {
    record = {kPoolTerminated, {}, e.what(), 0, 0, 0};
  } catch (const PoolClosed& e) {
    record = {kPoolClosed, {}, e.what(), 0, 0, 0};
  } catch (const Cancelled& e) {
    record = {kCancelled, {}, e.what(), 0, 0, 0};
  } catch (const TimeoutError& e) {
    record = {kTimeoutError, {}, e.what(), 0, 0, 0};
  } catch (const ProtocolError& e) {
    record = {kProtocolError, {}, e.what(), 0, 0, 0};
  } catch (const Error& e) {
    record = {kError, {}, e.what(), 0, 0, 0};
  } catch (...) {
    auto [type, text] = forkpool::detail::describe_current_exception();
    record = {kOther, type, text, 0, 0, 0};
  }
  return record;
}

std::exception_ptr rebuild_error(const ErrorRecord& r) {
  auto pid = static_cast<pid_t>(r.pid);
  switch (r.type) {
    case kRemoteError: return std::make_exception_ptr(RemoteError(r.type_name, r.message, pid));
    case kInitializerError: return std::make_exception_ptr(InitializerError(r.type_name, r.message, pid));
    case kWorkerLost: return std::make_exception_ptr(WorkerLost(pid, r.exit_code, r.signal));
    case kPoolTerminated: return std::make_exception_ptr(PoolTerminated());
    case kPoolClosed: return std::make_exception_ptr(PoolClosed());
    case kCancelled: return std::make_exception_ptr(Cancelled());
    case kTimeoutError: return std::make_exception_ptr(TimeoutError(r.message));
    case kProtocolError: return std::make_exception_ptr(ProtocolError(r.message));
    case kError: return std::make_exception_ptr(Error(r.message));
    default: return std::make_exception_ptr(Error("forkpool::mpi: " + r.type_name + ": " + r.message));
  }
}

void write_error(Writer& w, const ErrorRecord& r) {
  w.write(r.type);
  w.write(r.type_name);
  w.write(r.message);
  w.write(r.pid);
  w.write(r.exit_code);
  w.write(r.signal);
}

ErrorRecord read_error(Reader& r) {
  ErrorRecord record;
  record.type = r.read<std::uint8_t>();
  record.type_name = r.read<std::string>();
  record.message = r.read<std::string>();
  record.pid = r.read<std::int64_t>();
  record.exit_code = r.read<std::int32_t>();
  record.signal = r.read<std::int32_t>();
  return record;
}

}  // namespace forkpool::mpi::detail
