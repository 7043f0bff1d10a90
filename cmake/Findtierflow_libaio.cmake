# Finds libaio (no CMake config of its own) and defines the imported target
# tierflow::libaio that tierflow's exported targets link. Searched in
# CMAKE_PREFIX_PATH, then the system (Debian: libaio-dev).
find_path(TIERFLOW_LIBAIO_INCLUDE_DIR libaio.h)
find_library(TIERFLOW_LIBAIO_LIBRARY aio)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(tierflow_libaio REQUIRED_VARS TIERFLOW_LIBAIO_LIBRARY TIERFLOW_LIBAIO_INCLUDE_DIR
                                  REASON_FAILURE_MESSAGE "install the Debian package libaio-dev or add its prefix to CMAKE_PREFIX_PATH")
if(tierflow_libaio_FOUND AND NOT TARGET tierflow::libaio)
  add_library(tierflow::libaio UNKNOWN IMPORTED)
  set_target_properties(tierflow::libaio PROPERTIES IMPORTED_LOCATION "${TIERFLOW_LIBAIO_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${TIERFLOW_LIBAIO_INCLUDE_DIR}")
endif()
