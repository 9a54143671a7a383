// posenc/version.hpp — the library version, the one place it is written: CMakeLists.txt reads the
// three numbers below for project(VERSION) and the installed package's version file.
#pragma once

#define POSENC_VERSION_MAJOR 0
#define POSENC_VERSION_MINOR 1
#define POSENC_VERSION_PATCH 0

#define POSENC_DETAIL_STRINGIFY_(x) #x
#define POSENC_DETAIL_STRINGIFY(x) POSENC_DETAIL_STRINGIFY_(x)
/// "MAJOR.MINOR.PATCH", e.g. "0.1.0".
#define POSENC_VERSION                                                                     \
  POSENC_DETAIL_STRINGIFY(POSENC_VERSION_MAJOR)                                            \
  "." POSENC_DETAIL_STRINGIFY(POSENC_VERSION_MINOR) "." POSENC_DETAIL_STRINGIFY(POSENC_VERSION_PATCH)
