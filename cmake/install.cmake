# `cmake --install build --prefix P` puts tierflow's C++ package under P:
# headers in P/include, static libraries in P/lib, and the CMake package
# (tierflowConfig.cmake, its version file, the exported targets and the
# finders of libaio and xxHash) in P/lib/cmake/tierflow. See Note [Installed
# package] in cmake/tierflowConfig.cmake.in.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(tierflow_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/tierflow")
set(tierflow_layers core allocator swap tiering optimizer)

# Static archives linked into the user's binary: position-independent (they
# may end up in a shared library, as in tierflow._C) and with hidden
# visibility, so a shared library built from them exports only what its own
# author marks as exported and two such libraries in one process never
# interpose each other's tierflow symbols.
foreach(layer ${tierflow_layers})
  set_target_properties(tierflow_${layer} PROPERTIES EXPORT_NAME ${layer} POSITION_INDEPENDENT_CODE ON
                        CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
endforeach()
set_target_properties(tierflow_warnings PROPERTIES EXPORT_NAME detail_warnings)

foreach(layer ${tierflow_layers})
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  list(APPEND tierflow_layer_targets tierflow_${layer})
endforeach()
install(TARGETS ${tierflow_layer_targets} tierflow tierflow_warnings EXPORT tierflowTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT tierflowTargets NAMESPACE tierflow:: DESTINATION ${tierflow_cmake_dir})

set(TIERFLOW_INSTALLED_TORCH OFF)
if(TARGET tierflow_torch)
  set(TIERFLOW_INSTALLED_TORCH ON)
  set_target_properties(tierflow_torch PROPERTIES EXPORT_NAME torch
                        CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/bindings/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(TARGETS tierflow_torch EXPORT tierflowTorchTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT tierflowTorchTargets NAMESPACE tierflow:: DESTINATION ${tierflow_cmake_dir})
endif()

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/tierflowConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/tierflowConfig.cmake
                              INSTALL_DESTINATION ${tierflow_cmake_dir})
# 0.x: a minor version may change the API.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/tierflowConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tierflowConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/tierflowConfigVersion.cmake
              ${CMAKE_CURRENT_LIST_DIR}/Findtierflow_libaio.cmake ${CMAKE_CURRENT_LIST_DIR}/Findtierflow_xxhash.cmake
        DESTINATION ${tierflow_cmake_dir})
