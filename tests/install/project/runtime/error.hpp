#pragma once
// The user's own runtime/error.hpp: forkpool's headers must not be found in its place, nor it in
// forkpool's.
namespace user_project {
inline constexpr int kOwnErrorHeader = 1;
}
